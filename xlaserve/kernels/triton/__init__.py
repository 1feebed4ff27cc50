"""jax-triton kernels (GPU only).  `import xlaserve.kernels.triton` stays cheap: jax-triton and
triton are imported when a kernel is first called, because jax-triton needs a GPU at import."""

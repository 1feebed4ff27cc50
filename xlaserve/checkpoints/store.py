"""The on-disk model folder that `xlaserve convert` writes and the server loads:

    MODEL/
      config.json             ModelConfig
      params/                 orbax checkpoint of the parameter pytree
      tokenizer.json | tokenizer.model
      tokenizer_config.json   chat template, special tokens

Loading restores each array straight into its target sharding on the mesh: orbax reads only the
slices a device holds, so no host ever materialises a full copy of a sharded parameter.  A
quantized folder (`xlaserve convert --quantize int8|fp8`) holds each layer matrix as {"q", "scale"}
(models/quantize.py); a float folder served quantized is quantized on the devices as it loads.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params
from xlaserve.models.quantize import quantize_params
from xlaserve.sharding.layout import ShardLayout

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"


def check_output(out: str | Path, overwrite: bool, src: str | Path | None = None) -> None:
    """Refuse an output folder that exists (unless `overwrite`), or one whose replacement would
    delete the working directory or the source being converted."""
    if str(out).strip() == "":
        raise CheckpointError("output folder is empty: name a new folder for the model")
    resolved = Path(out).resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise CheckpointError(f"{out}: output folder is the current directory or one of its "
                              f"parents ({resolved}); name a new folder for the model")
    if src is not None:
        source = Path(src).resolve()
        if source == resolved or resolved in source.parents:
            raise CheckpointError(f"{out}: output folder would replace the source {src}; "
                                  f"name a different folder for the model")
    if resolved.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists (pass --overwrite to replace it)")


@contextmanager
def atomic_folder(out: str | Path, overwrite: bool = False,
                  src: str | Path | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` only if the block succeeds.

    A failed or interrupted conversion leaves no half-written model folder behind, and an
    existing `out` (with `overwrite`) survives any failure: it is renamed to a backup sibling,
    the new folder renamed into place, and only then is the backup deleted.  If the second
    rename fails the backup is renamed back."""
    check_output(out, overwrite, src)
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    backup = out.parent / f".{out.name}.old-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        try:
            if out.exists():
                os.replace(out, backup)
            os.replace(tmp, out)
        except BaseException:
            if backup.exists():
                os.replace(backup, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def save_params(folder: Path, params: Params) -> None:
    """Save host arrays, or jax Arrays as they are placed: each device writes its own shards, so
    saving from a mesh never gathers a parameter; any mesh can restore the result."""
    import orbax.checkpoint as ocp

    arrays = jax.tree_util.tree_map(
        lambda a: a if isinstance(a, jax.Array) else np.asarray(a), params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((folder / PARAMS_DIR).absolute(), arrays)
        ckptr.wait_until_finished()


def load_config(folder: str | Path, dtype: str | None = None,
                quantization: str | None = None) -> ModelConfig:
    """The model folder's config, to be served in `dtype` and with `quantization` ("int8",
    "fp8": a float checkpoint is quantized as it loads, load_params) where they are given."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{folder}: not a model folder (no {CONFIG_FILE}); "
                              f"create one with `xlaserve convert`")
    config = ModelConfig.load(path)
    if quantization is not None and quantization != config.quantization:
        if config.quantization is not None:
            raise CheckpointError(f"{folder}: holds {config.quantization} weights, which "
                                  f"cannot be served as {quantization}; convert the source "
                                  f"again without --quantize")
        config = config.replace(quantization=quantization)
    return config.replace(dtype=dtype) if dtype else config


def load_params(folder: str | Path, config: ModelConfig, mesh: Mesh) -> Params:
    """Restore the parameters of `folder` directly into their shardings on `mesh`.

    The checkpoint holds global arrays, whatever mesh saved it; each device reads only its
    slice (its heads, its pipeline stage's layers).  Raises ValueError if the model cannot be
    laid out on `mesh`."""
    import orbax.checkpoint as ocp

    folder = Path(folder)
    # What the folder holds (a bare parameter folder, without config.json, holds `config`'s).
    stored = load_config(folder).quantization if (folder / CONFIG_FILE).exists() \
        else config.quantization
    if stored != config.quantization and stored is not None:
        raise CheckpointError(f"{folder}: holds {stored} weights, not {config.quantization}")
    layout = ShardLayout.create(config, mesh)
    on_disk = layout if stored == config.quantization else \
        ShardLayout.create(config.replace(quantization=stored), mesh)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore((folder / PARAMS_DIR).absolute(), on_disk.param_targets(mesh))
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder}: no parameters ({e})") from e
    if stored == config.quantization:
        return params
    # A float checkpoint served quantized: quantized where it lies, each scale computed over
    # its channel's (possibly sharded) contracted axes, the result in the quantized layout.
    return jax.jit(partial(quantize_params, mode=config.quantization),
                   out_shardings=layout.param_shardings(mesh))(params)

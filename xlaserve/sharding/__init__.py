"""Where arrays live on devices, and the model step that runs across them.

    MeshConfig (mesh.py, configs/*.toml [mesh])  pipeline x tensor, times replicas
      -> make_mesh / make_replica_meshes          one jax Mesh per replica
      -> ShardLayout.create(model, mesh)           per-model rules (rules.py): which logical axis
                                                   is split over which mesh axis; refuses what
                                                   cannot work with the numbers
           .param_shardings / .kv_sharding        checkpoints restore straight into these
           .init_kv_cache(mesh, blocks, bs)        the zero KV cache, placed (the runner's)
      -> make_forward(model, mesh)                 models.llama.forward on one device, else the
                                                   same signature on the mesh (parallel_forward.py:
                                                   tensor parallel layers, microbatched pipeline)
      -> device_bytes(layout, ...)                 parameter and KV bytes per device (memory.py)
"""

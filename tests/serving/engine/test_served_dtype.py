"""A served model's weight dtype: `[[models]] dtype` in the server config, or `--dtype` on
`xlaserve serve` / `worker` for every model, reaches the engine the config builds (its
weights and its model config), and a dtype the engines cannot run is refused up front."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.multidevice.engine_workload import save_model_folder
from tests.serving.engine.conftest import TINY_CONFIG
from xlaserve.models.llama import init_params
from xlaserve.serving.config_file import with_model_overrides
from xlaserve.serving.engine.factory import threaded_engines as build
from xlaserve.serving.loading import serving_dtype
from xlaserve.serving.server_config import BUILTIN_ENGINE, ServedModel, ServerConfig

ENGINE_ARGS = {"max_model_len": 64, "block_size": 16, "num_kv_blocks": 8, "max_num_seqs": 2,
               "max_num_batched_tokens": 32, "max_prefill_chunk": 32, "min_table_width": 4}


def test_the_dtype_reaches_the_engine(tmp_path, model_dir) -> None:
    folder = save_model_folder(tmp_path / "tiny", init_params(TINY_CONFIG, 0), TINY_CONFIG,
                               model_dir)
    for dtype, want in ((None, jnp.float32), ("auto", jnp.float32), ("bfloat16", jnp.bfloat16)):
        served = ServedModel(name="tiny", path=str(folder), engine=BUILTIN_ENGINE,
                             engine_args=ENGINE_ARGS, dtype=dtype)
        (engine,) = build(served)
        runner = engine.engine.runner
        assert runner.config.dtype == jnp.dtype(want).name
        assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(runner.params)} == \
            {jnp.dtype(want)}
        # the CPU kernels' panels only for the float32 they run
        assert runner.packed == (runner.backend == "cpu" and want == jnp.float32)


def test_command_line_sets_every_model() -> None:
    models = (ServedModel(name="a", engine_args={"max_num_seqs": 4}),
              ServedModel(name="b", dtype="float16"))
    config = with_model_overrides(ServerConfig(models=models), dtype="bfloat16",
                                  mesh="configs/tp2.toml")
    assert [m.dtype for m in config.models] == ["bfloat16", "bfloat16"]
    assert config.models[0].engine_args == {"max_num_seqs": 4, "mesh": "configs/tp2.toml"}
    same = with_model_overrides(ServerConfig(models=models))
    assert [m.dtype for m in same.models] == ["auto", "float16"]


def test_an_unknown_dtype_is_refused_with_its_value() -> None:
    with pytest.raises(ValueError, match=r"models\[m\]\.dtype='int8': choose from "
                                         r"\['auto', 'float32', 'bfloat16', 'float16'\]"):
        ServedModel(name="m", dtype="int8")


def test_auto_is_float32_on_the_cpu_and_bfloat16_on_accelerators() -> None:
    assert serving_dtype("auto", "cpu") == "float32"
    assert serving_dtype("auto", "gpu") == "bfloat16"
    assert serving_dtype("auto", "tpu") == "bfloat16"
    assert serving_dtype(None, "gpu") is None            # the model folder's
    assert serving_dtype("float16", "cpu") == "float16"

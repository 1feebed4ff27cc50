"""`xlaserve generate` samples with the server's sampler: for one seed it gives the text that
the server's engine (built by the same factory, other requests beside it) gives."""

from __future__ import annotations

from dataclasses import replace

from tests.multidevice.engine_workload import save_model_folder
from tests.serving.engine.conftest import TINY_CONFIG
from xlaserve.models.llama import init_params
from xlaserve.serving.engine.factory import build_engines, engine_config
from xlaserve.serving.generate import generate_text, single_request_engine
from xlaserve.serving.types import GenerationRequest, SamplingParams

SERVER_ARGS = {"max_model_len": 64, "block_size": 16, "num_kv_blocks": 32, "max_num_seqs": 4,
               "max_num_batched_tokens": 64, "max_prefill_chunk": 32, "min_table_width": 4}


def test_generate_gives_the_servers_text_for_a_seed(tmp_path, model_dir) -> None:
    folder = save_model_folder(tmp_path / "tiny", init_params(TINY_CONFIG, 0, scale=0.5),
                               TINY_CONFIG, model_dir)
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    prompt = [5, 17, 300, 41, 9]
    alone = "".join(generate_text(single_request_engine(folder, 64), prompt, sampling))

    [server] = build_engines(folder, engine_config(SERVER_ARGS))   # every bucket compiled
    server.add(GenerationRequest("other", [8, 8, 1000, 3, 77, 12, 6], replace(sampling, seed=1)))
    server.add(GenerationRequest("same", prompt, sampling))
    server.add(GenerationRequest("seed8", prompt, replace(sampling, seed=8)))
    texts: dict[str, str] = {}
    for event in server.run_until_done():
        texts[event.request_id] = texts.get(event.request_id, "") + event.text
    assert len(alone) > 12   # twelve tokens of text
    assert texts["same"] == alone
    assert texts["seed8"] != alone   # the seed decides, not the batch

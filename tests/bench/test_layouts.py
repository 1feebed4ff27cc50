"""`xlaserve bench layouts`: per-device bytes of SmolLM2 on the mesh presets."""

from __future__ import annotations

from xlaserve.cli import main


def test_layouts_split_the_weights(model_dir, capsys) -> None:
    assert main(["bench", "layouts", "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: [float(x) for x in line.split()[-3:]]
            for line in out.splitlines() if line.startswith(("1 device", "tp3 ", "tp3x"))}
    one, tp3 = rows["1"], rows["tp3"]
    assert abs(tp3[1] - one[1] / 3) < 0.01          # KV heads split 3 ways
    assert one[0] / 3 < tp3[0] < one[0] / 2         # weights split, norms replicated
    assert "refused configs/tp2.toml" in out and "does not divide num_heads=9" in out


def test_layouts_of_a_moe_model_on_the_ep_presets(tmp_path, capsys) -> None:
    """A Mixtral-style config: the ep presets split the experts (params per device shrink with
    the expert count, KV stays whole since attention is replicated over `expert`), ep2 x tp2
    also splits the KV heads; the dense-only tp3 presets are refused with the reason."""
    from xlaserve.models.config import ModelConfig

    ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_layers=4,
                num_heads=8, num_kv_heads=4, head_dim=64, architecture="mixtral",
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                norm_topk_prob=True).save(tmp_path / "config.json")
    assert main(["bench", "layouts", "--model", str(tmp_path), "--num-blocks", "256"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: [float(x) for x in line.split()[-3:]]
            for line in out.splitlines() if line.startswith(("1 device", "ep", "tp2 "))}
    one, ep2, ep4, ep2tp2 = rows["1"], rows["ep2"], rows["ep4"], rows["ep2xtp2"]
    assert one[0] > ep2[0] > ep4[0] and ep2[1] == ep4[1] == one[1]
    experts = 4 * 8 * 3 * 512 * 1024 * 4 / 2 ** 20                # MiB of expert weights
    assert abs((one[0] - ep2[0]) - experts / 2) < 0.01
    assert abs((one[0] - ep4[0]) - experts * 3 / 4) < 0.01
    assert abs(ep2tp2[1] - one[1] / 2) < 0.01 and ep2tp2[0] < ep2[0] / 2 + 1
    assert "refused configs/tp3.toml" in out and "does not divide num_heads=8" in out

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

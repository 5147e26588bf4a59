"""CI-safe smoke runs of ``moetrain bench moe`` and ``moetrain bench train`` (tiny shapes, one round).

They check the harness, never the timings: every candidate runs, gets the same weights and input (so in fp32 every
MoE implementation's output equals the ``loop`` reference, and both models' initial loss is the same), and the JSON
report holds what docs/performance.md's table is built from.
"""

from __future__ import annotations

import json
import statistics

import pytest

from moetrain.cli import main


def cpu_from_proc() -> tuple[str, list[str]]:
    """The CPU model name and native-bf16 flags, read here from /proc/cpuinfo (what the reports must record)."""
    text = open("/proc/cpuinfo").read()
    name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags"))
    return name, sorted(set(flags) & {"avx512_bf16", "amx_bf16"})


def assert_cpu_recorded(machine: dict, header: str) -> None:
    """The report's machine names the CPU model and its bf16 flags, and the bench header prints them."""
    import os

    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo to check the CPU fields against")
    name, flags = cpu_from_proc()
    assert machine["cpu_model"] == name and machine["bf16_flags"] == flags
    assert isinstance(machine["bf16_fast"], bool) and machine["bf16_reason"]
    assert f"CPU {name}, native bf16: {' '.join(flags) or 'none'} (bf16 " in header, header


def test_bench_moe_smoke(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--grid", "smoke", "--reps", "1", "--warmup", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "moe" and report["machine"]["threads"] >= 1
    assert [(r["label"], r["dtype"]) for r in report["results"]] == [
        ("E=4 K=2 D=32 F=16 T=64", "fp32"), ("E=4 K=2 D=32 F=16 T=64", "bf16"),
        ("E=8 K=3 D=32 F=8 T=48", "fp32"), ("E=8 K=3 D=32 F=8 T=48", "bf16")]
    for rec in report["results"]:
        cands = rec["candidates"]
        assert list(cands) == ["dense", "hf-eager", "hf-grouped_mm", "loop", "padded", "grouped_mm", "fused"]
        assert cands["dense"]["ratio_to_dense"] == 1.0
        shape = rec["shape"]
        assert rec["active_gflop"] == pytest.approx(
            18 * shape["tokens"] * shape["top_k"] * shape["hidden"] * shape["ffn"] / 1e9)
        for name, c in cands.items():
            assert c["min_s"] <= c["median_s"] <= c["max_s"] and len(c["times_s"]) == 1
            assert c["peak_bytes"] > 0, name  # forward + backward allocate (saved activations, gradients)
            if name != "dense" and rec["dtype"] == "fp32":
                assert c["max_rel_err_vs_loop"] < 1e-5, name  # same weights, same routing, same answer
        assert cands["loop"]["peak_bytes"] > 0  # at least the saved activations are seen
    text = capsys.readouterr().out
    assert "wrote" in text
    assert_cpu_recorded(report["machine"], text.splitlines()[0])


def test_bench_writes_under_the_temp_dir_by_default(tmp_path, monkeypatch, capsys):
    """Without --json the report goes to a new file under <temp>/moetrain-bench, nothing into the current directory;
    a second run writes another file, and the old grid name still selects the standard grid."""
    import tempfile

    from moetrain.bench.moe import GRIDS, _grid_name

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    argv = ["bench", "moe", "--grid", "smoke", "--reps", "1", "--warmup", "0", "--no-memory", "--candidates", "loop"]
    assert main(argv) == 0
    first = capsys.readouterr().out.rsplit("wrote ", 1)[1].strip()
    assert first.startswith(str(tmp_path / "tmp" / "moetrain-bench" / "moe-")) and first.endswith(".json")
    assert json.loads(open(first).read())["benchmark"] == "moe"
    assert list((tmp_path / "cwd").iterdir()) == []
    assert main(argv) == 0
    second = capsys.readouterr().out.rsplit("wrote ", 1)[1].strip()
    assert second != first and json.loads(open(first).read())["benchmark"] == "moe"
    assert _grid_name("readme") == "standard" and "standard" in GRIDS


def test_bench_moe_rejects_bad_shape(capsys):
    assert main(["bench", "moe", "--shape", "8,2,512"]) == 2
    assert "--shape" in capsys.readouterr().err


def test_bench_train_smoke(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--preset", "tiny", "--batch", "2", "--seq", "16", "--steps", "1",
                 "--warmup", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert_cpu_recorded(report["machine"], next(s for s in capsys.readouterr().out.splitlines()
                                                if s.startswith("bench train:")))
    cands = report["candidates"]
    assert list(cands) == ["moetrain-fused", "moetrain-grouped_mm", "hf-grouped_mm", "hf-eager"]
    assert report["tokens_per_step"] == 32
    static = {c["weights_and_adam_bytes"] for c in cands.values()}
    assert len(static) == 1  # identical models: same weights, same AdamW state
    for name, c in cands.items():
        assert c["lm_loss_diff"] < 1e-4, name  # the same weights give the same initial cross-entropy
        assert c["tokens_per_s"] > 0 and c["peak_bytes"] > 0
    # The speed-ups are derived from the recorded medians: the faster HF candidate is the reference (exactly 1.0),
    # and every candidate's figure is that candidate's median over its own.
    hf = {n: cands[n]["median_s"] for n in ("hf-grouped_mm", "hf-eager")}
    assert report["best_hf"] == min(hf, key=hf.get)
    for name, c in cands.items():
        assert c["median_s"] == pytest.approx(statistics.median(c["times_s"]), rel=1e-12), name
        assert c["speedup_vs_best_hf"] == pytest.approx(min(hf.values()) / c["median_s"], rel=1e-12), name
        assert c["tokens_per_s"] == pytest.approx(report["tokens_per_step"] / c["median_s"], rel=1e-12), name


def test_bench_train_expert_overrides(tmp_path):
    # --experts / --top-k / --expert-ffn reshape the preset's MoE for both models; weights still map one to one
    # (the same initial cross-entropy) and the parameter count follows E * 3 * D * F per layer.
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--preset", "tiny", "--batch", "2", "--seq", "16", "--steps", "1", "--warmup",
                 "0", "--backends", "fused", "--hf", "eager", "--experts", "6", "--top-k", "3", "--expert-ffn", "8",
                 "--no-memory", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["model"]["experts"], report["model"]["top_k"], report["model"]["expert_ffn"]) == (6, 3, 8)
    assert report["candidates"]["hf-eager"]["lm_loss_diff"] < 1e-4


def test_bench_train_rejects_bad_expert_override(capsys):
    assert main(["bench", "train", "--preset", "tiny", "--experts", "2", "--top-k", "3"]) == 2
    assert "top_k" in capsys.readouterr().err


def test_bench_moe_vary_routing_feeds_new_tokens_every_call(tmp_path, capsys):
    # --vary-routing: every step overwrites the candidate's input with new tokens (same sequence for every
    # candidate), so routing and the per-expert GEMM shapes change from call to call, as in training.
    import torch

    from moetrain.bench.moe import Shape, _build

    built = _build(Shape(4, 2, 16, 8, 32), torch.float32, ["dense", "fused", "loop"], seed=0, vary_routing=True)
    outputs = {}
    for name in ("fused", "loop"):
        step, output = built[name]
        first = output().detach().clone()
        step()
        outputs[name] = (first, output().detach().clone())
    for first, after in outputs.values():
        assert not torch.equal(first, after)  # new tokens were fed by the step
    torch.testing.assert_close(outputs["fused"][1], outputs["loop"][1], atol=1e-5, rtol=1e-5)  # the same new tokens
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--grid", "smoke", "--reps", "1", "--warmup", "0", "--vary-routing",
                 "--candidates", "fused", "--no-memory", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["args"]["vary_routing"] is True
    assert "new tokens every call" in capsys.readouterr().out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("bench", ["moe", "train"])
def test_bench_device_cuda_without_cuda_is_refused(tmp_path, capsys, bench):
    out = tmp_path / "x.json"
    assert main(["bench", bench, "--device", "cuda", "--json", str(out)]) == 2
    assert "--device cuda" in capsys.readouterr().err and not out.exists()


def test_gpu_check_script_is_valid_bash_and_its_bench_commands_parse():
    # benchmarks/gpu_check.sh is the prepared device check (run on a lent GPU machine, never in CI): it must parse,
    # and every moetrain command in it must be accepted by moetrain's own argument parser.
    import shlex
    import subprocess
    from pathlib import Path

    from moetrain.cli import build_parser

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")  # join continued lines
    commands = [line.split("python3 -m moetrain ", 1)[1] for line in text.splitlines()
                if "python3 -m moetrain " in line and not line.lstrip().startswith("#")]
    assert len(commands) == 3
    parser = build_parser()
    for command in commands:
        args = parser.parse_args(shlex.split(command.replace('"$out/', '"out/')))
        assert args.device == "cuda" and args.dtype == "bf16" and args.overwrite

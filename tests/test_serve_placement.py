"""``moetrain placement`` (moetrain/serve/placement.py, commands/placement.py): EPLB's replicate-then-pack against
a hand-computed example, the predicted max/mean load per rank falling with replication, and the two JSON files
(SGLang's ``--init-expert-location`` map, and ours read back by ``load_placement``)."""

from __future__ import annotations

import json

import pytest
import torch

from _serve_util import train_tiny

from moetrain.cli import main
from moetrain.errors import MoetrainError
from moetrain.serve.placement import LayerPlacement, load_placement, pack, place, place_layer, replicate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_hand_computed_example():
    """E = 4 experts with 60/20/10/10 assignments on 2 ranks.

    No placement (experts 0,1 on rank 0; 2,3 on rank 1): loads 80 / 20, max/mean 1.6.
    R = 0: pack 60 -> r0, 20 -> r1, 10 -> r1 (30 < 60), 10 -> r0 (r1 full): loads 70 / 30, 1.4.
    R = 2: replicate expert 0 (60 > 20), then again (30 > 20): 3 replicas of 20, P = 6, 3 per rank;
    pack 20 -> r0, 20 -> r1, 20 -> r0 (tie: lower rank), 20 -> r1, 10 -> r0, 10 -> r1: loads 50 / 50, 1.0.
    """
    counts = [60.0, 20.0, 10.0, 10.0]
    r0 = place_layer(counts, 2, 0)
    assert r0.load_before == [80, 20] and LayerPlacement.imbalance(r0.load_before) == pytest.approx(1.6)
    assert r0.physical_to_logical == [0, 3, 1, 2] and r0.replicas == [1, 1, 1, 1]
    assert r0.load_after == [70, 30] and LayerPlacement.imbalance(r0.load_after) == pytest.approx(1.4)
    r2 = place_layer(counts, 2, 2)
    assert r2.replicas == [3, 1, 1, 1]
    assert r2.physical_to_logical == [0, 0, 2, 0, 1, 3]
    assert r2.load_after == [50, 50] and LayerPlacement.imbalance(r2.load_after) == 1.0
    # the building blocks on their own
    assert replicate([9.0, 3.0, 2.0], 5) == [3, 1, 1]  # expert 0: 9 -> 4.5 -> 3 per replica
    assert pack([5.0, 4.0, 3.0, 3.0], 2) == [0, 1, 1, 0]


def test_replication_never_raises_the_predicted_max_load():
    torch.manual_seed(0)
    counts = torch.rand(6, 8) ** 3 * 1000  # skewed usage
    prev = None
    for r in (0, 4, 8, 12):
        layers = place(counts, 4, r)
        worst = [max(lp.load_after) for lp in layers]
        for lp, row in zip(layers, counts.double().tolist()):
            assert sum(lp.replicas) == 8 + r and sorted(set(lp.physical_to_logical)) == list(range(8))
            assert sum(lp.load_after) == pytest.approx(sum(row))  # replicas split an expert's load, none is lost
            assert len(lp.physical_to_logical) == 8 + r
        if prev is not None:  # greedy, so not monotone per layer in general; over these 6 layers it is
            assert sum(worst) <= sum(prev) + 1e-9
        prev = worst
    layers = place(counts, 4, 12)
    assert all(max(lp.load_after) < max(lp.load_before) for lp in layers)
    assert max(LayerPlacement.imbalance(lp.load_after) for lp in layers) < min(
        LayerPlacement.imbalance(lp.load_before) for lp in layers)


def test_bad_sizes_name_the_flag():
    with pytest.raises(MoetrainError, match="--redundant: 4 experts \\+ 1 redundant = 5 physical"):
        place_layer([1.0] * 4, 2, 1)
    with pytest.raises(MoetrainError, match="--ep: 3 ranks do not divide the 4 experts"):
        place_layer([1.0] * 4, 3, 2)
    with pytest.raises(MoetrainError, match="--ep: must be >= 1"):
        place_layer([1.0] * 4, 0, 0)


def test_cli_writes_sglang_and_our_format(tmp_path, capsys):
    run = train_tiny(tmp_path)
    capsys.readouterr()
    assert main(["placement", str(run), "--ep", "2", "--redundant", "2", "--out", str(tmp_path / "pl")]) == 0
    out = capsys.readouterr().out
    assert "mean over layers:" in out and "metrics.jsonl steps" in out
    sgl = json.loads((tmp_path / "pl" / "placement-ep2-r2.sglang.json").read_text())
    assert list(sgl) == ["physical_to_logical_map"]  # SGLang passes the dict as keyword arguments
    ours_path = tmp_path / "pl" / "placement-ep2-r2.json"
    ours = json.loads(ours_path.read_text())
    assert ours["ep"] == 2 and ours["redundant"] == 2 and set(ours["layers"]) == {"0", "1"}
    assert len(sgl["physical_to_logical_map"]) == 2  # tiny: 2 transformer layers, both MoE
    for b in ("0", "1"):
        assert sgl["physical_to_logical_map"][int(b)] == ours["layers"][b]["physical_to_logical"]
        assert ours["layers"][b]["rank_of_physical"] == [0, 0, 0, 1, 1, 1]
        before, after = ours["layers"][b]["predicted_load_before"], ours["layers"][b]["predicted_load_after"]
        assert max(after) <= max(before) + 1e-9
    # the printed figures are the file's
    for b in ("0", "1"):
        lay = ours["layers"][b]
        line = f"layer {b}: {LayerPlacement.imbalance(lay['predicted_load_before']):.3f} -> " \
               f"{LayerPlacement.imbalance(lay['predicted_load_after']):.3f}"
        assert line in out
    loaded = load_placement(ours_path, [0, 1], 4)
    assert loaded[1].physical_to_logical == ours["layers"]["1"]["physical_to_logical"]
    with pytest.raises(MoetrainError, match="num_experts: 4, the model has 8"):
        load_placement(ours_path, [0, 1], 8)
    with pytest.raises(MoetrainError, match="layers.2: missing"):
        load_placement(ours_path, [0, 1, 2], 4)
    ours["layers"]["0"]["physical_to_logical"] = [0, 0, 1, 1, 2, 2]
    ours_path.write_text(json.dumps(ours))
    with pytest.raises(MoetrainError, match="every expert needs a replica; missing \\[3\\]"):
        load_placement(ours_path, [0, 1], 4)
    assert main(["placement", str(run), "--ep", "3"]) == 2  # a usage error
    assert "--ep: 3 ranks do not divide the 4 experts" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("placement"))


def test_cli_never_overwrites_an_earlier_placement_silently(tiny_run, tmp_path, capsys):
    """A second placement into the same directory (here from other calibration text) is refused, naming the file
    and --overwrite, and leaves both earlier files as they were; --overwrite replaces them, leaving no temp files."""
    out = tmp_path / "pl"
    argv = ["placement", str(tiny_run), "--ep", "2", "--redundant", "2", "--out", str(out)]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["placement-ep2-r2.json", "placement-ep2-r2.sglang.json"]
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    capsys.readouterr()
    assert main([*argv, "--calibration-text", str(text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out / "placement-ep2-r2.json") in err[0] and "--overwrite" in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main([*argv, "--calibration-text", str(text), "--overwrite"]) == 0
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(after) == sorted(before) and after != before
    assert json.loads(after["placement-ep2-r2.json"])["usage"].startswith("calibration")


def test_cli_empty_calibration_text_names_the_flag_and_the_file(tiny_run, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    capsys.readouterr()
    assert main(["placement", str(tiny_run), "--ep", "2", "--calibration-text", str(empty),
                 "--out", str(tmp_path / "pl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--calibration-text" in err[0] and str(empty) in err[0] and "at least 2 tokens" in err[0], err
    assert not (tmp_path / "pl").exists()  # nothing written

"""moe/kernels/cpu/hugepages.py: the advice covers only whole 2 MiB pages inside a tensor's storage, the kernel then
backs the buffer with huge pages (read back from /proc/self/smaps), and nothing else changes."""

from __future__ import annotations

import mmap
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moetrain.moe.kernels.cpu import hugepages
from moetrain.moe.fast_moe import fused_moe

MiB = 1 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled (always / madvise / never), if any."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def _anon_huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) summed over this process's mappings that overlap ``t``'s storage (/proc/self/smaps; the
    advice splits a mapping at the advised range)."""
    lo = t.untyped_storage().data_ptr()
    hi = lo + t.untyped_storage().nbytes()
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's header: start-end perms offset dev inode path
            start, end = (int(v, 16) for v in head.split("-"))
            overlaps = start < hi and lo < end
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def _fault_fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("madvise", "always"),
                               reason="transparent huge pages unavailable (not Linux, or mode 'never')")


def _touched(advise: bool) -> torch.Tensor:
    """16 MiB of fp32 (at least 7 whole aligned huge pages) on a fresh private mapping of their own. Not from
    ``torch.empty``: that may return addresses of malloc's heap that an earlier advice in this process (the fused
    layer's, in a full test run) already covers, and then an unadvised tensor gets huge pages too."""
    t = torch.frombuffer(mmap.mmap(-1, 16 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.float32)
    if advise:
        hugepages.advise(t, kept=True)
    t.fill_(1.0)
    return t


@needs_thp
def test_an_advised_buffer_is_backed_by_huge_pages(monkeypatch):
    monkeypatch.delenv("MOETRAIN_HUGEPAGES", raising=False)
    before = _fault_fallbacks()
    t = _touched(advise=True)
    huge = _anon_huge_kib(t)
    if huge == 0 and _fault_fallbacks() > before:
        pytest.skip("the kernel had no free huge page (thp_fault_fallback rose)")
    assert huge >= 2 * 1024, f"AnonHugePages {huge} kB"


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only in madvise mode do pages depend on the advice")
@pytest.mark.parametrize("switch", [None, "0"])
def test_without_the_advice_or_switched_off_the_pages_stay_small(monkeypatch, switch):
    if switch is None:
        t = _touched(advise=False)
    else:
        monkeypatch.setenv("MOETRAIN_HUGEPAGES", switch)
        assert not hugepages.enabled()
        t = _touched(advise=True)
    assert _anon_huge_kib(t) == 0


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, address, length, advice):
        self.calls.append((address, length, advice))
        return 0


@pytest.mark.parametrize("nbytes", [4 * MiB, 5 * MiB + 12, 17 * MiB, 64 * MiB + 4096])
def test_only_whole_aligned_pages_inside_the_storage_are_advised(monkeypatch, nbytes):
    recorder = _Recorder()
    monkeypatch.setattr(hugepages, "_madvise", recorder)
    monkeypatch.delenv("MOETRAIN_HUGEPAGES", raising=False)
    t = torch.empty(nbytes, dtype=torch.uint8)
    view = t[3:-5]  # the storage, not the view, is what is advised
    assert hugepages.advise(view, kept=True) is view
    start, end = t.data_ptr(), t.data_ptr() + nbytes
    page = hugepages.HUGE_PAGE_BYTES
    first, last = -(-start // page) * page, end // page * page
    assert recorder.calls == [(first, last - first, 14)]
    assert start <= first and first + (last - first) <= end and first % page == 0 and (last - first) % page == 0


def test_buffers_freed_after_a_call_are_advised_only_on_a_mapping_of_their_own(monkeypatch):
    """Below glibc's largest mmap threshold a block may come from the heap, whose addresses later allocations reuse
    (the advice would outlive the buffer): only kept buffers are advised there."""
    recorder = _Recorder()
    monkeypatch.setattr(hugepages, "_madvise", recorder)
    monkeypatch.delenv("MOETRAIN_HUGEPAGES", raising=False)
    small = torch.empty(hugepages.OWN_MAPPING_BYTES - 4, dtype=torch.uint8)
    hugepages.advise(small)
    assert recorder.calls == []
    hugepages.advise(small, kept=True)
    big = torch.empty(hugepages.OWN_MAPPING_BYTES, dtype=torch.uint8)
    hugepages.advise(big)
    assert [call[0] // hugepages.HUGE_PAGE_BYTES for call in recorder.calls] == [
        -(-t.data_ptr() // hugepages.HUGE_PAGE_BYTES) for t in (small, big)]


def test_small_non_cpu_and_fake_tensors_are_left_alone(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(hugepages, "_madvise", recorder)
    for t in (torch.empty(MiB // 4), torch.empty(0), torch.empty(16 * MiB, device="meta")):
        assert hugepages.advise(t, kept=True) is t
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a fake tensor's data pointer warns (and will raise)
        with FakeTensorMode():
            fake = torch.empty(16 * MiB)
        assert hugepages.advise(fake, kept=True) is fake
    assert recorder.calls == []


def test_tensors_without_a_plain_storage_are_left_alone(monkeypatch):
    """Sparse and mkldnn tensors and functorch's wrappers have no storage to read (untyped_storage() raises)."""
    recorder = _Recorder()
    monkeypatch.setattr(hugepages, "_madvise", recorder)
    monkeypatch.delenv("MOETRAIN_HUGEPAGES", raising=False)
    dense = torch.zeros(2048, 2048)  # 16 MiB
    others = [dense.to_sparse()]
    if torch.backends.mkldnn.is_available():
        others.append(dense.to_mkldnn())
    for t in others:
        assert hugepages.advise(t, kept=True) is t
    # Inside the transforms, x * 2 is a wrapper tensor of type torch.Tensor: advise passes it through unchanged.
    grad = torch.func.grad(lambda x: hugepages.advise(x * 2, kept=True).sum())(dense)
    assert torch.equal(grad, torch.full_like(dense, 2))
    assert torch.equal(torch.func.vmap(lambda row: hugepages.advise(row * 2, kept=True))(dense), dense * 2)
    assert recorder.calls == []
    assert hugepages.advise(dense, kept=True) is dense and len(recorder.calls) == 1  # a plain tensor is advised


def test_the_switch_and_a_missing_libc_turn_the_advice_off(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(hugepages, "_madvise", recorder)
    for value in ("0", "off", "False", " no "):
        monkeypatch.setenv("MOETRAIN_HUGEPAGES", value)
        hugepages.advise(torch.empty(8 * MiB // 4), kept=True)
    assert recorder.calls == []
    monkeypatch.setenv("MOETRAIN_HUGEPAGES", "1")
    monkeypatch.setattr(hugepages, "_madvise", None)
    assert not hugepages.enabled()
    t = torch.empty(8 * MiB // 4)
    assert hugepages.advise(t) is t


def test_the_fused_layer_gives_the_same_bits_with_and_without_huge_pages(monkeypatch):
    calls = []
    real = hugepages._madvise
    if real is not None:  # count the advice given, and give it
        monkeypatch.setattr(hugepages, "_madvise", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(hugepages, "OWN_MAPPING_BYTES", 4 * MiB)  # advise this small layer's buffers too
    torch.manual_seed(0)
    t, d, f, e, k = 1024, 512, 256, 16, 4  # h [4096, 512] fp32 = 8 MiB, weight gradients 8 + 4 MiB
    x = torch.randn(t, d)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    weights = torch.rand(t, k)
    w_in, w_out = torch.randn(e, 2 * f, d) * 0.05, torch.randn(e, d, f) * 0.05
    grad = torch.randn(t, d)
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("MOETRAIN_HUGEPAGES", switch)
        leaves = [v.clone().requires_grad_() for v in (x, weights, w_in, w_out)]
        out = fused_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        out.backward(grad)
        results.append([out.detach(), *(v.grad for v in leaves)])
    for on, off in zip(*results, strict=True):
        assert torch.equal(on, off)
    assert real is None or len(calls) >= 3  # h, d_in, d_out at least (with "1"; none with "0")

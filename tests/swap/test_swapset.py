"""SwapSet on plain modules: bit-exact round trips, freed memory, exact byte counters, clear errors.

Everything runs on the CPU "device" (the same code path as CUDA, with ordinary tensors); the CUDA-only
checks at the end are skipped where no GPU is present.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from openrl_lab.swap import HostArena, SwapSet, SwapStateError, global_counters, switch

CUDA = torch.cuda.is_available()
# Deselected by default (pyproject addopts: -m "not cuda"); run on a GPU machine with `pytest -m cuda`.
needs_cuda = pytest.mark.cuda


def _model(seed: int = 0, device="cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)).to(device)


def _batch(step: int, device="cpu"):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, 16, generator=g).to(device), torch.randn(12, 8, generator=g).to(device)


def _backward(model, step, device="cpu"):
    x, y = _batch(step, device)
    ((model(x) - y) ** 2).mean().backward()


def _train(model, opt, steps, start=0, device="cpu"):
    for s in range(start, start + steps):
        _backward(model, s, device)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _state(model, opt) -> dict[str, torch.Tensor]:
    """Every value that matters, cloned: weights, grads, optimizer state."""
    out = {}
    for i, p in enumerate(model.parameters()):
        out[f"p{i}"] = p.detach().clone()
        if p.grad is not None:
            out[f"g{i}"] = p.grad.clone()
        for k, v in opt.state.get(p, {}).items():
            out[f"s{i}.{k}"] = v.clone()
    return out


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
        assert torch.equal(v, b[k]), f"{k} differs"


def _swap_set(model, opt, packed=True, device="cpu", name="job") -> SwapSet:
    ss = SwapSet(name, device, packed=packed)
    ss.add_module(model)
    ss.add_optimizer(opt)
    return ss


# ------------------------------------------------------------------------------------ bit-exactness


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_hundred_round_trips_are_bit_exact_and_training_continues_like_a_twin(packed):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, 3)
    _train(twin, twin_opt, 3)
    _backward(model, 3)  # a slice may end between forward_backward and optim_step: grads are pending
    _backward(twin, 3)
    ss = _swap_set(model, opt, packed)
    params = list(model.parameters())
    before = _state(model, opt)

    for _ in range(100):
        ss.evict()
        ss.restore()
    _assert_same(_state(model, opt), before)
    assert list(model.parameters()) == params and opt.param_groups[0]["params"] == params  # same objects
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))

    opt.step()
    opt.zero_grad(set_to_none=True)
    twin_opt.step()
    twin_opt.zero_grad(set_to_none=True)
    for step in range(4, 10):  # swap between every phase from now on
        _backward(model, step)
        ss.evict()
        ss.restore()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ss.evict()
        ss.restore()
        _backward(twin, step)
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
    _assert_same(_state(model, opt), _state(twin, twin_opt))
    assert ss.counters.evictions == 112 and ss.counters.restores == 112


def test_optimizer_state_created_after_registration_is_swapped():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ss = _swap_set(model, opt)
    weights_only = ss.nbytes
    assert weights_only == sum(p.nbytes for p in model.parameters())
    _train(model, opt, 1)  # AdamW creates exp_avg, exp_avg_sq and step now
    assert ss.nbytes == 3 * weights_only + 4 * len(list(model.parameters()))  # + the fp32 step counters
    before = _state(model, opt)
    ss.evict()
    ss.restore()
    _assert_same(_state(model, opt), before)


def test_loose_tensors_of_any_dtype_layout_and_aliasing():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    named = {
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "f16": torch.randn(3).half(),
        "i64": torch.arange(10),
        "u8": torch.arange(200, dtype=torch.uint8),
        "bool": torch.rand(9) > 0.5,
        "scalar": torch.tensor(3.5),
        "transposed": torch.randn(6, 4).t(),  # non-contiguous, covers its storage
        "rows": base[:2],  # two views that together cover one storage
        "tail": base[2:],
        "empty": torch.empty(0, 3),
    }
    originals = {k: (v.clone(), v.stride(), v.storage_offset()) for k, v in named.items()}
    ids = {k: id(v) for k, v in named.items()}
    for packed in (True, False):
        ss = SwapSet("loose", "cpu", packed=packed)
        ss.add_tensors(named)
        for i in range(3):
            if packed and i == 0:
                # A view keeps its base tensor alive (autograd's view link): that memory stays, and is reported.
                with pytest.warns(RuntimeWarning, match="still referenced"):
                    stats = ss.evict()
                assert stats.retained_bytes == base.nbytes + named["transposed"].nbytes
            else:
                assert ss.evict().retained_bytes == 0
            assert torch.isnan(named["bf16"].float()).all()  # evicted floats read as NaN, not stale data
            with pytest.raises(RuntimeError):
                named["f16"].add_(1)  # and refuse writes
            ss.restore()
        for k, (value, stride, _) in originals.items():
            assert id(named[k]) == ids[k]
            assert named[k].dtype == value.dtype and named[k].shape == value.shape
            assert named[k].stride() == stride, k
            assert torch.equal(named[k], value), k
        if packed:  # the two views still share memory after the round trip
            assert named["rows"].untyped_storage().data_ptr() == named["tail"].untyped_storage().data_ptr()
            assert named["tail"].storage_offset() - named["rows"].storage_offset() == 12
        # (per tensor, tensors that only touch inside a buffer made by a packed set get memory of their own)
        named["rows"].add_(0)  # writable again
        ss.close()  # a later set takes the (packed) tensors over


# ------------------------------------------------------------------------------------ memory release


def test_eviction_frees_the_device_memory():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    _backward(model, 1)
    ss = _swap_set(model, opt)
    storages = [weakref.ref(t.untyped_storage()) for t in ss.named_tensors().values()]
    assert len(storages) == 6 * 3 + 6 + 6  # 6 parameters: weights, grads, exp_avg, exp_avg_sq, step
    stats = ss.evict()
    gc.collect()
    assert stats.retained_bytes == 0
    assert all(r() is None for r in storages)  # every original storage is gone
    for name, t in ss.named_tensors().items():  # what remains is one broadcast element per tensor
        assert t.untyped_storage().nbytes() == t.element_size(), name
        assert t.shape != () or t.numel() == 1
    ss.restore()
    packed = {
        t.untyped_storage().data_ptr(): weakref.ref(t.untyped_storage()) for t in ss.named_tensors().values()
    }.values()
    assert len(packed) == 2  # one buffer for the state, one for the grads
    ss.evict()
    gc.collect()
    # the grads buffer is gone; the state buffer's storage stays, with no memory, for the next restore
    assert sorted(0 if r() is None else 1 + r().nbytes() for r in packed) == [0, 1]


def test_references_from_outside_keep_memory_and_are_reported():
    model = _model()
    ss = SwapSet("job", "cpu")
    ss.add_module(model)
    alias = model[0].weight.detach()  # someone outside the set holds the memory
    with pytest.warns(RuntimeWarning, match="still referenced"):
        stats = ss.evict()
    assert stats.retained_bytes == alias.nbytes
    ss.restore()
    del alias


def test_an_alias_of_a_packed_buffer_stays_valid_and_is_reported():
    model = _model()
    ss = SwapSet("job", "cpu")
    ss.add_module(model)
    ss.evict()
    ss.restore()  # now packed: one buffer, freed by shrinking it at the next eviction...
    alias = model[2].bias.detach()  # ...unless something outside still looks at it
    value = alias.clone()
    with pytest.warns(RuntimeWarning, match="still referenced"):
        stats = ss.evict()
    assert stats.retained_bytes >= stats.bytes_moved
    assert torch.equal(alias, value)  # the outside reference was not left dangling
    ss.restore()
    assert torch.equal(model[2].bias, value)
    del alias
    assert ss.evict().retained_bytes == 0  # the new buffer has no outside users
    ss.restore()


def test_a_tensor_rebound_from_outside_is_noticed():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    ss = _swap_set(model, opt)
    ss.pack()
    new = torch.randn(8, 32)
    model[2].weight.data = new.clone()  # replaced behind the set's back: the packed layout no longer holds
    before = _state(model, opt)
    stats = ss.evict()
    assert stats.bytes_moved == sum(t.nbytes for t in ss.named_tensors().values())
    ss.restore()
    _assert_same(_state(model, opt), before)
    assert torch.equal(model[2].weight, new)
    assert ss.evict().copies == 1  # packed again
    ss.restore()


def test_without_torch_use_counts_packed_buffers_are_dropped_instead(monkeypatch):
    import openrl_lab.swap.layout as layout

    monkeypatch.setattr(layout, "_storage_use_count", None)  # a torch that does not tell
    model = _model()
    ss = SwapSet("job", "cpu")
    ss.add_module(model)
    before = {k: v.clone() for k, v in ss.named_tensors().items()}
    for _ in range(3):
        ss.evict()
        ss.restore()
        storage = weakref.ref(model[0].weight.untyped_storage())
        assert ss.evict().retained_bytes == 0
        assert storage() is None  # freed by dropping every reference, not by shrinking it
        ss.restore()
    after = ss.named_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_dropped_gradients_free_their_packed_buffer():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    _backward(model, 1)
    ss = _swap_set(model, opt)
    ss.evict()
    ss.restore()
    grad_storage = weakref.ref(model[0].weight.grad.untyped_storage())
    state_storage = weakref.ref(model[0].weight.untyped_storage())
    assert grad_storage() is not state_storage()  # grads live in their own buffer...
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad_storage() is None  # ...which goes away with them
    assert state_storage() is not None
    stats = ss.evict()
    assert stats.copies == 1 and stats.bytes_moved == ss.nbytes
    ss.restore()


# ----------------------------------------------------------------------------------- packing, copies


def test_packed_state_moves_in_one_copy_each_way():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    ss = _swap_set(model, opt)
    n_tensors = len(ss.named_tensors())
    first = ss.evict()
    assert first.copies == n_tensors  # before packing: one copy per tensor
    assert ss.restore().copies == 1
    again = ss.evict()
    assert again.copies == 1 and again.tensors == n_tensors
    assert ss.restore().copies == 1
    _backward(model, 1)  # grads: a second buffer
    assert ss.evict().copies == 1 + 6
    assert ss.restore().copies == 2
    assert ss.evict().copies == 2
    ss.restore()


def test_pack_keeps_values_and_identity():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 2)
    ss = _swap_set(model, opt)
    params = list(model.parameters())
    before = _state(model, opt)
    stats = ss.pack()
    assert stats.direction == "pack" and ss.counters.bytes_moved == 0  # nothing crossed to the host
    _assert_same(_state(model, opt), before)
    assert all(a is b for a, b in zip(model.parameters(), params))
    ptrs = {t.untyped_storage().data_ptr() for t in ss.named_tensors().values()}
    assert len(ptrs) == 1
    start = ss.named_tensors()["0.weight"].untyped_storage().data_ptr()  # the CPU allocator aligns to 64
    assert all((t.data_ptr() - start) % 256 == 0 and t.data_ptr() % 64 == 0 for t in ss.named_tensors().values())
    assert ss.evict().copies == 1
    ss.restore()
    _train(model, opt, 1)  # packed views train fine


def test_a_big_set_copies_in_the_background_and_frees_cleanly():
    big = nn.Linear(1024, 1024)  # 4 MB: on a CPU device the copies run in a worker thread
    opt = torch.optim.AdamW(big.parameters())
    big(torch.randn(4, 1024)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ss = _swap_set(big, opt)
    before = {k: v.clone() for k, v in ss.named_tensors().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "still referenced" false alarm from a copy in flight
        for _ in range(20):
            e = ss.evict()
            r = ss.restore()
            assert e.retained_bytes == 0
    assert e.copies == r.copies == 1 and e.bytes_moved > (1 << 20) * 4
    after = ss.named_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_per_tensor_mode_never_packs():
    model = _model()
    packed = SwapSet("packed", "cpu")
    packed.add_module(model)
    packed.pack()
    packed.close()  # the tensors stay views of one buffer...
    ss = SwapSet("job", "cpu", packed=False)
    ss.add_module(model)
    for _ in range(3):  # ...and the per-tensor set gives each its own memory again
        assert ss.evict().copies == 6
        assert ss.restore().copies == 6
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 6


def test_stale_slots_in_a_packed_buffer_are_skipped():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    extra = {"snapshot": torch.randn(1000)}
    ss = _swap_set(model, opt)
    ss.add_tensors(extra)
    ss.pack()
    p0 = model[0].weight
    opt.state[p0]["exp_avg"] = opt.state[p0]["exp_avg"].clone()  # replaced: its old slot is now stale
    del extra["snapshot"]  # dropped: a stale slot too
    expected = sum(t.nbytes for t in ss.named_tensors().values())
    before = _state(model, opt)
    stats = ss.evict()
    assert stats.bytes_moved == expected
    ss.restore()
    _assert_same(_state(model, opt), before)


def test_arena_is_allocated_once_and_reused():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    arena = HostArena()
    ss = SwapSet("job", "cpu", arena=arena)
    ss.add_module(model)
    ss.add_optimizer(opt)
    ss.reserve()  # room for the state and the grads the weights may get
    assert arena.grows == 1
    for step in range(5):
        ss.evict()
        ss.restore()
        _backward(model, step)  # grads come and go
        ss.evict()
        ss.restore()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert arena.grows == 1


# ---------------------------------------------------------------------------------------- counters


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_counters_are_exact(packed):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    ss = _swap_set(model, opt, packed)
    start = global_counters()
    _train(model, opt, 3)  # lazy yield: nobody waited, nothing moved
    assert ss.counters.bytes_moved == 0 and global_counters().bytes_moved == start.bytes_moved
    _backward(model, 3)
    expected = sum(t.nbytes for t in ss.named_tensors().values())
    n = len(ss.named_tensors())
    for _ in range(3):
        e = ss.evict()
        r = ss.restore()
        assert e.bytes_moved == r.bytes_moved == expected == ss.nbytes
        assert e.tensors == r.tensors == n and e.direction == "evict" and r.direction == "restore"
        assert e.seconds > 0 and r.seconds > 0
    c = ss.counters
    assert (c.evictions, c.restores, c.bytes_evicted, c.bytes_restored) == (3, 3, 3 * expected, 3 * expected)
    assert c.bytes_moved == 6 * expected
    assert global_counters().bytes_moved - start.bytes_moved == 6 * expected


def test_switch_moves_one_out_and_the_other_in():
    a, b = _model(0), _model(1)
    sa, sb = SwapSet("a", "cpu"), SwapSet("b", "cpu")
    sa.add_module(a)
    sb.add_module(b)
    wb = b[0].weight.clone()
    sb.evict()
    out, into = switch(sa, sb)
    assert (out.direction, into.direction) == ("evict", "restore")
    assert not sa.resident and sb.resident
    assert out.bytes_moved == sa.nbytes and into.bytes_moved == sb.nbytes
    assert torch.equal(b[0].weight, wb)
    with pytest.raises(SwapStateError):
        switch(sa, sb)  # sb is resident: nothing to restore
    with pytest.raises(ValueError):  # noqa: PT011 - a set switched with itself
        switch(sb, sb)
    switch(sb, sa)
    assert sa.resident and not sb.resident


# ------------------------------------------------------------------------------------------- errors


def test_state_errors_are_specific():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    ss = _swap_set(model, opt)
    with pytest.raises(SwapStateError, match="resident"):
        ss.restore()
    ss.evict()
    with pytest.raises(SwapStateError, match="evicted"):
        ss.evict()
    with pytest.raises(SwapStateError, match=r"evicted.*Linear"):
        model(torch.randn(2, 16))
    with pytest.raises(SwapStateError, match=r"evicted.*AdamW"):
        opt.step()
    with pytest.raises(SwapStateError, match="evicted"):
        ss.add_module(nn.Linear(2, 2))
    ss.restore()
    model(torch.randn(2, 16))  # works again
    opt.step()


def test_bad_registrations_are_refused():
    ss = SwapSet("job", "cpu")
    with pytest.raises(ValueError, match="matches"):
        ss.add_module(_model(), lambda name: "lora" in name)
    with pytest.raises(TypeError):
        ss.add_optimizer("adam")
    getter = SwapSet("getter", "cpu")
    getter.add_optimizer(lambda: "not an optimizer")
    with pytest.raises(TypeError, match="returned str"):
        getter.evict()
    with pytest.raises(TypeError):
        ss.add_tensors([torch.zeros(1)])
    big = torch.zeros(100)
    view = SwapSet("view", "cpu")
    view.add_tensors({"part": big[:10]})
    with pytest.raises(SwapStateError, match="shares its memory"):
        view.evict()
    assert view.resident  # nothing happened
    sparse = SwapSet("sparse", "cpu")
    sparse.add_tensors({"s": torch.eye(3).to_sparse()})
    with pytest.raises(SwapStateError, match="layout"):
        sparse.evict()
    if CUDA:
        with pytest.raises(ValueError, match="none of"):
            SwapSet("gpu", "cuda").add_module(_model())


def test_a_tensor_in_two_sets_is_caught():
    model = _model()
    s1, s2 = SwapSet("one", "cpu"), SwapSet("two", "cpu")
    s1.add_module(model)
    s2.add_module(model[0])
    s1.evict()
    with pytest.raises(SwapStateError, match="another SwapSet"):
        s2.evict()
    s1.restore()


def test_close_removes_the_guards():
    model = _model()
    ss = SwapSet("job", "cpu")
    ss.add_module(model)
    ss.evict()
    ss.close()
    assert ss.resident and ss.arena.capacity == 0
    out = model(torch.randn(2, 16))  # no guard any more: the dropped state reads as NaN
    assert torch.isnan(out).all()


# --------------------------------------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_cuda_round_trips_free_memory_and_stay_bit_exact(packed):
    dev = "cuda"
    model = _model(device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    _train(model, opt, 2, device=dev)
    _train(twin, twin_opt, 2, device=dev)
    big = nn.Linear(2048, 2048, device=dev)  # ~16 MB, so the drop is far above allocator noise
    ss = _swap_set(model, opt, packed, device=dev)
    ss.add_module(big)
    assert (ss.arena.pin and ss.arena.buffer.is_pinned()) or ss.arena.capacity == 0
    before = _state(model, opt)
    w = big.weight.detach().clone()
    for _ in range(20):
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        stats = ss.evict()
        assert torch.cuda.memory_allocated() <= allocated - big.weight.nbytes
        assert stats.retained_bytes == 0
        ss.restore()
    assert ss.arena.buffer.is_pinned()
    _assert_same(_state(model, opt), before)
    assert torch.equal(big.weight, w)
    _train(model, opt, 3, start=2, device=dev)
    _train(twin, twin_opt, 3, start=2, device=dev)
    _assert_same(_state(model, opt), _state(twin, twin_opt))


@needs_cuda
def test_cuda_switch_overlaps_and_is_exact():
    a, b = _model(0, "cuda"), _model(1, "cuda")
    sa, sb = SwapSet("a", "cuda"), SwapSet("b", "cuda")
    sa.add_module(a)
    sb.add_module(b)
    wa, wb = a[0].weight.clone(), b[0].weight.clone()
    sb.evict()
    for _ in range(10):
        switch(sa, sb)
        switch(sb, sa)
    assert torch.equal(a[0].weight, wa)
    sb.restore()
    assert torch.equal(b[0].weight, wb)

"""Paged KV cache: page accounting (no leaks, shared prompt pages, preemption), the Pallas kernels in
interpret mode, and the paged engine against the slotted one and the trainer."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampler import MESH1, TINY, _by_uid, _params, _prompts, _trainer_logprobs

from jaxrl_async.model import presets
from jaxrl_async.sampler import Engine, Request, SamplerConfig, SamplerLoop, paged
from jaxrl_async.sampler.page_table import (
    SCRATCH,
    PagePlanner,
    PageTable,
    SlotPlanner,
    pages_for,
    positions_after,
    shared_pages,
)
from jaxrl_async.sharding import make_mesh

MESH4 = make_mesh((2, 2), ("data", "tensor"), jax.devices()[:4])


def _loop(params, mesh=MESH1, **kw):
    base = dict(num_slots=4, max_prompt_len=16, max_new_tokens=12, steps_per_call=4, temperature=0.0)
    base.update(attention="paged_kernel", linear="xla", page_size=4)
    base.update(kw)
    if base["attention"] != "paged_kernel":
        base.pop("page_size")  # a slotted cache refuses a page size it would not read
    return SamplerLoop(Engine(TINY, params, mesh, SamplerConfig(**base)))


def _all_free(loop):
    pt = loop.planner.table
    return all(pt.num_free(d) == pt.capacity for d in range(pt.shards))


@pytest.fixture(scope="module")
def params():
    return _params()


def test_page_table_has_no_leak_after_1000_random_insert_finish_cycles():
    rng = np.random.default_rng(0)
    ps, width = 4, 8
    pt = PageTable(num_slots=8, shards=2, pages_per_shard=24, width=width, page_size=ps)
    groups: dict[int, tuple[int, list[int]]] = {}  # group id -> (shard, shared pages held by the group)
    members = collections.Counter()  # group id -> slots still holding its shared pages
    slot_group: dict[int, int] = {}
    for cycle in range(1000):
        slot = int(rng.integers(8))
        if pt.slot_pages(slot):  # finish the sequence in this slot
            g = slot_group.pop(slot)
            pt.release(slot)
            members[g] -= 1
            if members[g] == 0 and rng.random() < 0.5:  # the group has inserted all its samples
                shard, held = groups.pop(g)
                pt.decref(shard, held)
        else:  # insert a sample, sharing an existing group's prompt pages half of the time
            shard = pt.shard_of(slot)
            same_shard = [g for g, (d, _) in groups.items() if d == shard]
            prompt = int(rng.integers(1, 4 * ps))
            total = pages_for(positions_after(prompt, 8, 1, 4), ps)
            if same_shard and rng.random() < 0.5:
                g = same_shard[0]
                held = groups[g][1]
            else:
                n_shared = shared_pages(prompt, ps)
                if pt.num_free(shard) < total:
                    continue
                g, held = cycle, pt.alloc(shard, n_shared)
                groups[g] = (shard, held)
            private = min(width, total) - len(held)
            if private < 0 or pt.num_free(shard) < private:
                continue
            pt.assign(slot, held, private)
            slot_group[slot] = g
            members[g] += 1
            if rng.random() < 0.5:
                pt.grow(slot, int(rng.integers(1, width + 1)))
        pt.check(holds=list(groups.values()))
    for slot in list(slot_group):
        pt.release(slot)
    for shard, held in groups.values():
        pt.decref(shard, held)
    pt.check()
    assert all(pt.num_free(d) == pt.capacity for d in range(2)) and not pt.table.any()


def test_shared_prompt_pages_are_freed_only_when_the_last_holder_lets_go():
    pt = PageTable(num_slots=4, shards=1, pages_per_shard=16, width=6, page_size=4)
    prompt = 10  # positions 0..8 are shared: pages 0 and 1 of the prompt (2 full pages)
    held = pt.alloc(0, shared_pages(prompt, 4))
    assert len(held) == 2
    for slot in range(3):
        pt.assign(slot, held, 2)
    pt.decref(0, held)  # the group has inserted all three samples
    for slot in range(3):
        assert all(pt.refcount(0, p) == 3 - slot for p in held)
        free_before = pt.num_free(0)
        pt.release(slot)
        freed = pt.num_free(0) - free_before
        assert freed == (4 if slot == 2 else 2)  # private pages always, shared ones with the last sample
    assert pt.num_free(0) == pt.capacity and not pt.table.any()
    with pytest.raises(RuntimeError, match="released more often"):
        pt.decref(0, held)
    with pytest.raises(RuntimeError, match="pages wanted"):
        pt.alloc(0, 16)


def _planner(pages_per_shard=9):
    """8 slots over 2 shards (slots 0-3 and 4-7), pages of 4 positions, 4 steps per call, one prompt bucket
    of 16; uploads are counted instead of placed on a device."""
    uploads = []
    table = PageTable(num_slots=8, shards=2, pages_per_shard=pages_per_shard, width=6, page_size=4)
    return PagePlanner(table, 4, lambda p: 16, lambda t: uploads.append(t) or len(uploads)), uploads


def test_planner_shares_prompt_pages_and_places_by_room():
    pl, _ = _planner()
    # Prompt 9, 12 new tokens: positions 0..7 (2 full pages) are shared; the first call writes up to
    # position 11, so a sample starts with 3 pages.
    assert pl.first_pages(9, 12) == 3 and shared_pages(9, 4) == 2
    assert pl.group_pages(9, 12, 3, holds_shared=False) == 2 + 3 and pl.group_pages(9, 12, 3, True) == 3
    shared = {}
    first = pl.start(0, 9, 12, shared)
    second = pl.start(1, 9, 12, shared)
    rows = [pl.table.slot_pages(b) for b in (0, 1)]
    assert list(shared) == [0] and rows[0][:2] == rows[1][:2] == shared[0] and rows[0][2] != rows[1][2]
    assert all(pl.table.refcount(0, p) == 3 for p in shared[0])  # the group and both samples
    assert first.shape == (2, 4) and first[0, :3].tolist() == rows[0] and not first[1].any()
    assert second[0].tolist() == [SCRATCH, SCRATCH, rows[1][2], SCRATCH]  # shared chunks: not rewritten
    # Shard 0: 8 usable pages, 4 taken; once the first call is out each sample needs one more for the next.
    assert pl.table.num_free(0) == 4 and pl.room(0) == 4
    pl.dispatched()
    assert pl.room(0) == 2 and pl.room(1) == 8
    assert pl.admission_room([2, 4]) == 10
    assert pl.place(9, 12, [2, 4], shared) == 2  # the shard holding the group's prompt pages first
    assert pl.place(13, 12, [2, 4], {}) == 4  # a new prompt needs 4 pages: only shard 1 has them
    assert pl.place(13, 12, [2, 3], {}) is None
    assert pl.can_admit([2, 4], 16, 12) and not pl.can_admit([2, 3], 16, 12)
    pl.drop_shared(shared)
    assert not shared and all(pl.table.refcount(0, p) == 2 for p in rows[0][:2])
    pl.release(0), pl.release(0), pl.release(1)  # release is idempotent
    pl.table.check()
    assert pl.table.num_free(0) == pl.table.capacity


def test_planner_grow_drops_held_prompt_pages_then_names_the_youngest():
    pl, uploads = _planner(pages_per_shard=7)  # 6 usable pages per shard
    shared = {}
    pl.start(1, 9, 12, shared)  # admitted first, though in the higher slot
    pl.start(0, 9, 12, shared)
    assert pl.table.num_free(0) == 2
    pl.dispatched()
    assert pl.grow([shared]) == [] and pl.table.num_free(0) == 0  # 4 pages each for the second call
    assert pl.device_table() == (1,) and pl.device_table() == (1,)  # uploaded once per table version
    pl.dispatched()
    # The third call needs a fifth page each and none is free: the waiting group's holding goes first
    # (it frees nothing, the samples still reference those pages), then the youngest sample, slot 0.
    assert pl.grow([shared]) == [0]
    assert not shared and not pl.table.slot_pages(0) and len(pl.table.slot_pages(1)) == 5
    pl.table.check()
    assert pl.device_table() == (2,) and len(uploads) == 2
    pl.dispatched()
    assert pl.grow([]) == []  # slot 1 writes at most position 19: 5 pages


def test_slot_planner_admits_into_any_free_slot():
    pl = SlotPlanner()
    assert pl.can_admit([3], 16, 12) and not pl.can_admit([], 16, 12)
    assert pl.place(9, 12, [3, 1], {}) == 3 and pl.place(9, 12, [], {}) is None
    assert pl.start(3, 9, 12, {}) is None and pl.grow([{}]) == [] and pl.device_table() == ()
    assert pl.admission_room([3]) > 10**9 and pl.group_pages(9, 12, 4, False) == 0


def test_pallas_paged_kernels_in_interpret_mode_match_the_reference():
    """The GPU kernel (interpreted) is float32-exact; the TPU kernel reads K/V as bfloat16 (its design)."""
    rng = np.random.default_rng(0)
    b, h, g, k, ps, pages, width = 3, 4, 2, 32, 4, 16, 4
    q = jnp.asarray(rng.standard_normal((b, h, k), np.float32))
    kpool = jnp.asarray(rng.standard_normal((g, pages, ps, k), np.float32))
    vpool = jnp.asarray(rng.standard_normal((g, pages, ps, k), np.float32))
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[: b * width].reshape(b, width).astype(np.int32))
    lengths = jnp.asarray([1, 7, 16], jnp.int32)
    ref = paged.reference_attention(q, kpool, vpool, lengths, table)
    for impl, atol in (("gpu", 1e-5), ("tpu", 3e-2)):
        lay = paged.PagedLayout(MESH1, g, k, ps, pages, width, impl, interpret=True)
        out = paged._attend_local(lay, q, kpool, vpool, lengths, table)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=atol, rtol=0)


def test_device_kernels_run_whole_128_key_blocks_at_every_length():
    """On a device both kernels take blocks of 128 positions whatever the sequence length (8k-token
    sequences once ran in 1-page blocks); the GPU kernel splits a sequence in up to 16, and the table width
    is a multiple of both, at most twice the pages plus a block."""
    for ps, per in ((16, 8), (4, 32), (128, 1), (256, 1)):
        assert paged.pages_per_block(ps) == per
        for pages in (*range(1, 200), 516, 1000, 2049):
            for impl in ("gpu", "tpu"):
                width = paged.table_width(pages, ps, impl, False)
                splits, per_block = paged.PagedLayout(MESH1, 2, 16, ps, 4, width, impl, False).blocks
                assert per_block == per and width % (splits * per_block) == 0
                assert pages <= width <= 2 * pages + per
                assert splits == 1 if impl == "tpu" else 1 <= splits <= 16
    width = paged.table_width(516, 16, "gpu", False)  # 8,256 positions: 65 blocks of 8 pages -> 80
    assert width == 640 and paged.PagedLayout(MESH1, 2, 16, 16, 4, width, "gpu", False).blocks == (16, 8)


def test_the_gpu_kernel_with_its_device_blocks_matches_the_reference():
    """The blocks a GPU runs (several splits, 8-page blocks) give the reference's attention (the kernel
    interpreted here), lengths ending mid-block, mid-split and at one token."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    rng = np.random.default_rng(1)
    b, h, g, k, ps, pages = 3, 4, 2, 32, 4, 40
    width = paged.table_width(20, 16, "gpu", False)  # the blocks of 16-position pages, on pages of 4
    splits, per_block = paged.PagedLayout(MESH1, g, k, 16, pages, width, "gpu", False).blocks
    assert (width, splits, per_block) == (32, 4, 8)
    q = jnp.asarray(rng.standard_normal((b, h, k), np.float32)) * k**-0.5
    kpool, vpool = (jnp.asarray(rng.standard_normal((g, pages, ps, k), np.float32)) for _ in range(2))
    rows = [rng.permutation(np.arange(1, pages))[:width] for _ in range(b)]
    table = jnp.asarray(np.stack(rows).astype(np.int32))
    lengths = jnp.asarray([1, 37, 80], jnp.int32)
    out = gpu_paged.paged_attention(
        q, kpool, vpool, table, lengths, block_h=16, pages_per_compute_block=per_block, k_splits=splits,
        interpret=True,
    )  # fmt: skip
    ref = paged.reference_attention(q * k**0.5, kpool, vpool, lengths, table)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh", [MESH1, MESH4], ids=["1dev", "data2_tensor2"])
def test_paged_decode_equals_slotted_and_the_trainer(params, mesh):
    p = params if mesh is MESH1 else _params(mesh=mesh)
    prompts = _prompts(5, seed=3)
    outs = {}
    for attention in ("xla", "paged_kernel"):
        loop = _loop(p, mesh, attention=attention)
        for i, prompt in enumerate(prompts):
            loop.add_request(Request(i, prompt, n_samples=2, max_new_tokens=4 + i))
        outs[attention] = _by_uid(loop.run())
        if attention == "paged_kernel":
            assert _all_free(loop)
            loop.planner.table.check()
    assert outs["xla"].keys() == outs["paged_kernel"].keys() and len(outs["xla"]) == 10
    for key, c in outs["paged_kernel"].items():
        assert c.tokens.tolist() == outs["xla"][key].tokens.tolist()
        trainer = _trainer_logprobs(params, prompts[key[0]], c.tokens, 1.0)
        np.testing.assert_allclose(c.logprobs, trainer, atol=1e-5, rtol=0)


def test_group_samples_share_prompt_pages(params):
    loop = _loop(params, temperature=1.0)
    prompt = list(range(1, 14))  # 13 tokens: 3 full pages of 4 below position 12 are shared
    loop.add_request(Request("g", prompt, n_samples=4, seed=5, max_new_tokens=8))
    loop.step()
    pt = loop.planner.table
    rows = [pt.slot_pages(b) for b in range(4)]
    assert all(r[:3] == rows[0][:3] for r in rows)  # the shared prompt pages
    assert len({p for r in rows for p in r[3:]}) == sum(len(r) - 3 for r in rows)  # private pages differ
    assert all(pt.refcount(0, p) == 4 for p in rows[0][:3])
    assert pt.capacity - pt.num_free(0) == 3 + 4 * 1  # unshared it would be 4 x 4 pages
    loop.update_params(_params(seed=1), version=1, mode="keep_kv")  # the running samples keep their pages
    out = loop.run()
    assert len(out) == 4 and len({tuple(c.tokens) for c in out}) > 1 and _all_free(loop)
    assert all(c.versions[0] == 0 and c.versions[-1] == 1 for c in out)
    # Six samples on four slots: two wait in their group, which holds the prompt pages. A "finish" update
    # drops those pages (they hold the old weights' keys) and the two samples start under the new weights.
    loop.add_request(Request("h", prompt, n_samples=6, seed=6, max_new_tokens=8))
    loop.step()
    assert loop._groups and loop._groups[0].shared
    loop.update_params(params, version=2, mode="finish")
    out = _by_uid(loop.run())
    versions = sorted(tuple(set(c.versions.tolist())) for c in out.values())
    assert versions == [(1,)] * 4 + [(2,)] * 2 and _all_free(loop)
    loop.planner.table.check()


def test_preemption_requeues_and_loses_no_request(params):
    """A pool of 7 usable pages holds one full-length sequence: waiting groups give up their prompt pages,
    the youngest sequences are preempted and restarted from their prompts, and every request still
    completes with the tokens of an unconstrained run."""
    prompts = _prompts(6, seed=7, lo=5, hi=12)
    reqs = [Request(i, pr, n_samples=1 + i % 3, seed=i, max_new_tokens=12) for i, pr in enumerate(prompts)]
    runs = {}
    for budget in (None, 28):
        loop = _loop(params, temperature=1.0, token_budget=budget)
        it = iter(reqs)
        runs[budget] = (_by_uid(loop.run(lambda it=it: next(it, None))), loop)
    full, small = runs[None][0], runs[28][0]
    loop = runs[28][1]
    assert loop.stats.preemptions > 0 and runs[None][1].stats.preemptions == 0
    assert small.keys() == full.keys() and len(small) == sum(r.n_samples for r in reqs)
    for key, c in small.items():
        assert c.tokens.tolist() == full[key].tokens.tolist()  # the restart drew the same tokens
        np.testing.assert_allclose(c.logprobs, full[key].logprobs, atol=1e-5)  # other batch neighbours
    assert _all_free(loop) and loop.idle
    loop.planner.table.check()


def test_paged_recompute_kv_matches_slotted(params):
    """recompute_kv rewrites the live sequences' pages (shared prompt pages included) under new weights."""
    new = _params(seed=1)
    prompt = _prompts(1, seed=5)[0]
    out = {}
    for attention in ("xla", "paged_kernel"):
        loop = _loop(params, temperature=1.0, steps_per_call=2, overlap_host=False, attention=attention)
        loop.add_request(Request("a", prompt, n_samples=2, seed=3))
        loop.step(), loop.step()
        loop.update_params(new, version=1, mode="recompute_kv")
        out[attention] = _by_uid(loop.run())
    for key, c in out["paged_kernel"].items():
        ref = out["xla"][key]
        assert c.tokens.tolist() == ref.tokens.tolist() and c.versions.tolist() == [0] * 4 + [1] * 8
        np.testing.assert_allclose(c.logprobs, ref.logprobs, atol=1e-5)


def test_the_default_budget_holds_every_slot_in_whole_pages(params):
    """max_prompt_len + max_new_tokens = 28 positions need 7 pages of 4, or 2 of 16: the default budget
    rounds each slot up to them (28 x 4 slots in 16-position pages had been 7 pages for 8)."""
    for page_size, pages in ((4, 7), (16, 2)):
        cfg = SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=12, attention="paged_kernel",
                            page_size=page_size)  # fmt: skip
        assert cfg.token_budget == 4 * pages * page_size
    auto = SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=12)
    assert auto.token_budget == 4 * 28  # slotted until the engine resolves "auto"
    assert auto.with_kernels("xla", "xla").token_budget == 4 * 28
    assert auto.with_kernels("paged_kernel", "xla").token_budget == 4 * 2 * 16  # "auto" on TPU and GPU
    explicit = SamplerConfig(num_slots=4, max_prompt_len=16, max_new_tokens=12, token_budget=100)
    assert explicit.with_kernels("paged_kernel", "xla").token_budget == 100  # a budget set stays as set
    # One slot of 16 + 8 = 24 positions: the old default of 24 gave one page of 16, and the engine refused.
    loop = _loop(params, num_slots=1, page_size=16, max_new_tokens=8)
    loop.add_request(Request(0, _prompts(1, seed=5)[0], n_samples=1, max_new_tokens=8))
    assert len(_by_uid(loop.run())) == 1 and _all_free(loop)


def test_the_engine_says_what_its_cache_holds(params):
    """The line the runtime logs for each engine: the kernels it resolved, and how many longest sequences
    its pages hold beside the slots that may ask for them (a smaller token_budget holds fewer)."""
    text = _loop(params).engine.describe()  # 4 slots of 16 + 12 = 28 positions in pages of 4
    assert text.startswith("attention paged_kernel, linear xla (explicit); KV cache paged, 1 data shard(s) ")
    assert "of 28 pages of 4 positions" in text
    assert "4 sequences of 28 positions a shard for its 4 slots" in text
    assert "2 sequences of 28 positions" in _loop(params, token_budget=64).engine.describe()  # 16 pages
    slotted = _loop(params, attention="xla").engine.describe()
    assert slotted.endswith("KV cache slotted, 4 slots of 28 positions (token_budget 112)")


def test_paged_config_errors(params):
    with pytest.raises(ValueError, match="token_budget=24 gives 6 pages.*needs 7"):
        _loop(params, token_budget=24)
    mesh2 = make_mesh((2, 1), ("data", "tensor"), jax.devices()[:2])
    with pytest.raises(ValueError, match="per data shard \\(2 shards\\)"):
        _loop(_params(mesh=mesh2), mesh2, token_budget=40)
    with pytest.raises(ValueError, match="page_size"):
        SamplerConfig(page_size=0)
    loop = _loop(params)
    with pytest.raises(ValueError, match="exceeds the longest sequence max_prompt_len .* = 28"):
        loop.engine.check_fits(16, 13)
    with pytest.raises(ValueError, match="pass `page_table`"):
        loop.engine.generate(loop.engine.init_state())
    # A compile-only paged engine (the plan check's path) holds the page pools as arguments.
    cfg = SamplerConfig(
        num_slots=4, max_prompt_len=16, max_new_tokens=12, attention="paged_kernel", page_size=4
    )
    mem = Engine(TINY, None, MESH1, cfg).compile_generate().memory_analysis()
    pool_bytes = 2 * TINY.n_layers * TINY.n_kv_heads * (4 * 28 + 4) * TINY.head_dim * 4  # + scratch page
    assert mem.argument_size_in_bytes >= pool_bytes
    assert not SCRATCH and paged.table_width(7, 4, "gpu", True) == 8


def test_plan_sizes_paged_kv():
    from jaxrl_async.perf.system import kv_tokens_per_sequence
    from jaxrl_async.perf.workload import LogNormalLengths, Workload
    from jaxrl_async.runtime.plan_check import paged_kv_plan

    cfg = presets.tiny(vocab_size=256, n_layers=2)
    s = SamplerConfig(num_slots=64, max_prompt_len=16, max_new_tokens=48, page_size=8)
    plan = paged_kv_plan(cfg, s, (2, 1), 2**20, median_len=6, p99_len=48, group=4, prompt_len=12)
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # f32 K and V of one position
    assert plan["page_bytes"] == 8 * per_token and plan["pages_per_device"] == 2**20 // (8 * per_token)
    assert plan["sequences_at_max_len"] == 2 * (plan["pages_per_device"] // 8)  # 64 positions: 8 pages
    assert plan["sequences_slotted"] == 2 * (2**20 // (per_token * 64))
    tokens = kv_tokens_per_sequence(Workload(1, 4, 12, LogNormalLengths(6, 48, 48)), "paged", 8, 8)
    assert 8 < tokens < 64 and plan["sequences_long_tail"] == 2 * int(plan["pages_per_device"] * 8 // tokens)
    assert plan["sequences_long_tail"] > plan["sequences_at_max_len"]
    assert plan["decode_batch_long_tail"] == 64  # capped by num_slots


def test_megacore_splits_the_tpu_kernel_only_on_megacore_chips_and_refuses_what_would_hang():
    """v4 and v5p (one JAX device per chip, two TensorCores) split the kernel's grid; other chips and
    programs lowered here for an unknown chip run one core; an explicit split is refused where it could
    hang (a chip without megacore) or cannot divide (odd heads or slots a shard), naming the field."""
    for kind in ("TPU v4", "TPU v5", "TPU v5p"):
        assert paged.megacore_mode("auto", kind, 2, 64) == "kv_head"  # math_8b: 8 KV heads over tensor 4
        assert paged.megacore_mode("auto", kind, 1, 64) == "batch"
        assert paged.megacore_mode("auto", kind, 1, 5) is None
        assert paged.megacore_mode("off", kind, 2, 64) is None
    for kind in ("TPU v5 lite", "TPU v6 lite", "TPU v4 lite", "TPU7x", ""):
        assert paged.megacore_mode("auto", kind, 2, 64) is None
    assert paged.megacore_mode("batch", "", 1, 64) == "batch"  # lowered for a target named by the config
    for setting, kind, heads, slots, match in (
        ("kv_head", "TPU v6 lite", 2, 64, "no megacore"),
        ("kv_head", "TPU v5p", 1, 64, "even number of KV heads"),
        ("batch", "TPU v5p", 2, 5, "even number of slots"),
        ("both", "TPU v5p", 2, 64, "not in"),
    ):
        with pytest.raises(ValueError, match=f"SamplerConfig.megacore.*{match}"):
            paged.megacore_mode(setting, kind, heads, slots)
    with pytest.raises(ValueError, match="SamplerConfig.megacore has no effect"):
        SamplerConfig(attention="xla", megacore="kv_head")
    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])  # the GPU kernel (interpreted here)
    with pytest.raises(ValueError, match="SamplerConfig.megacore='batch': a TPU kernel setting"):
        Engine(presets.tiny(), None, mesh, SamplerConfig(attention="paged_kernel", megacore="batch"))


def test_the_tpu_kernel_split_over_two_cores_matches_the_reference_and_lowers_to_a_two_core_grid():
    """Both megacore splits (interpreted on two simulated cores) attend like the reference, and lowered for
    tpu the kernel's grid leads with the two cores (one without the split)."""
    rng = np.random.default_rng(2)
    b, h, g, k, ps, pages, width = 4, 4, 2, 32, 4, 24, 4
    q = jnp.asarray(rng.standard_normal((b, h, k), np.float32))
    kpool, vpool = (jnp.asarray(rng.standard_normal((g, pages, ps, k), np.float32)) for _ in range(2))
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[: b * width].reshape(b, width).astype(np.int32))
    lengths = jnp.asarray([1, 7, 16, 11], jnp.int32)
    ref = paged.reference_attention(q, kpool, vpool, lengths, table)
    for megacore in ("kv_head", "batch"):
        lay = paged.PagedLayout(MESH1, g, k, ps, pages, width, "tpu", True, megacore)
        out = paged._attend_local(lay, q, kpool, vpool, lengths, table)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-2, rtol=0)
    from jaxrl_async.runtime import lowering

    k, ps, width = 128, 16, 8  # a device's blocks: 8 pages of 16 positions, lanes of 128
    shapes = ((b, h, k), (g, pages, ps, k), (g, pages, ps, k), (b,), (b, width))
    dtypes = [jnp.bfloat16] * 3 + [jnp.int32] * 2
    spec = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    for megacore, cores in ((None, 1), ("kv_head", 2), ("batch", 2)):
        lay = paged.PagedLayout(MESH1, g, k, ps, pages, width, "tpu", False, megacore)
        traced = jax.jit(lambda *a, lay=lay: paged._attend_local(lay, *a)).trace(*spec)
        low = traced.lower(lowering_platforms=("tpu",))
        ((_, grid),) = lowering.mosaic_grids(low)
        assert grid[0] == cores, (megacore, grid)

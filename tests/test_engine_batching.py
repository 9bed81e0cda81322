"""The runner over the paged pool (tiny model) and the serving engine in-process (its real model thread):
batching, invariance, preemption, interleaving, cancellation and page accounting, with a real Valkey index and
real volumes for disk hits. The runner is held to the reference forward (model/reference.py)."""
import asyncio

import numpy as np
import pytest

from kvstore import CacheGeometry, PrefixIndex, block_hashes, cacheable_blocks, miss, open_redis
from model import reference
from model.attention import make_backend
from model.config import preset
from model.latent_pool import SCRATCH_PAGE, LatentPool
from model.runner import DECODE_VIEW_STEPS, MAX_PASS_TILES, DecodeRow, Runner, Segment, view_bucket
from model.sampling import SamplingParams
from model.serving import serving_model
from model.weights import init_model, save_model
from services.engine.block_manager import BlockManager
from services.engine.cache_link import CacheLink
from services.engine.config import EngineConfig
from services.engine.core import Engine
from services.engine.engine_metrics import EngineMetrics
from services.engine.scheduler import Plan, SchedulePolicy, Scheduler
from services.engine.sequence import Job, Sequence, Status

SALT = "5a" * 16
VOCAB = 129_280


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = preset("tiny")
    return save_model(init_model(cfg), cfg, tmp_path_factory.mktemp("tiny") / "model")


def check_pages(blocks: BlockManager, owners: list[list[int]]) -> None:
    """Raises AssertionError unless every page is free, hot or owned exactly as `owners` (the block tables of live
    sequences) say: the block manager's accounting, read from its state."""
    counts = [0] * blocks.num_pages
    for table in owners:
        for page in table:
            counts[page] += 1
    free, hot = set(blocks._free), set(blocks._hot)
    assert len(free) == len(blocks._free), "a page is on the free list twice"
    assert SCRATCH_PAGE not in free | hot and counts[SCRATCH_PAGE] == 0, "the scratch page was handed out"
    for page in range(blocks.num_pages):
        if page == SCRATCH_PAGE:
            continue
        states = (page in free) + (page in hot) + (counts[page] > 0)
        assert states == 1, f"page {page}: free={page in free} hot={page in hot} refs={counts[page]}"
        assert blocks._ref[page] == counts[page], f"page {page}: ref {blocks._ref[page]} != owners {counts[page]}"
    for h, page in blocks._page_of.items():
        assert blocks._hash_of.get(page) == h, f"page {page}: hash maps disagree"


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


class Running:
    """An Engine on its model thread, with its cache link (mounted volumes + Valkey, or none)."""

    def __init__(self, loaded, cfg: EngineConfig):
        self.loaded, self.cfg = loaded, cfg
        self.metrics = EngineMetrics()
        self.cache = CacheLink.for_model(cfg, loaded.config, loaded.fingerprint)  # cfg's latent format
        self.engine = Engine(loaded, cfg, self.cache, self.metrics)

    async def __aenter__(self):
        await self.cache.start()
        if self.cfg.caching:
            for _ in range(200):
                if self.cache.store is not None:
                    break
                await asyncio.sleep(0.05)
        self.engine.warm_up()
        self.engine.start(asyncio.get_running_loop())
        return self

    async def __aexit__(self, *exc):
        await self.engine.stop(10)
        await self.cache.close()

    def job(self, tokens, max_tokens=8, hit=None, digest=True, **params) -> Job:
        return Job(f"r{id(tokens)}", np.asarray(tokens, np.int64), "t", SALT, hit or miss(),
                   SamplingParams(max_tokens=max_tokens, **params), "chat", digest)

    async def generate(self, job: Job) -> tuple[list[int], list[str], dict]:
        ids, digests, done = [], [], None
        async for event in self.engine.run(job):
            if event["type"] == "token":
                ids.append(event["id"])
                digests.append(event.get("logits_sha256"))
            elif event["type"] == "done":
                done = event
            elif event["type"] == "error":
                raise AssertionError(event)
        return ids, digests, done

    async def hit(self, tokens) -> object:
        """The index's hit for `tokens` (as the gateway would look it up), once the saves are durable."""
        index = PrefixIndex(open_redis(self.cfg.redis_url), self.cfg.index_prefix)
        hashes = block_hashes(tokens.tolist(), self.cache.fingerprint, SALT, self.cfg.block_tokens)
        want = cacheable_blocks(len(tokens), self.cfg.block_tokens)
        for _ in range(200):
            found = await index.lookup(hashes[:want])
            if found.blocks == want:
                return found
            await asyncio.sleep(0.05)
        raise AssertionError(f"only {found.blocks} of {want} blocks were published")

    def check_pages(self) -> None:
        """Every page is free, hot, or owned exactly once by a live sequence's block table."""
        check_pages(self.engine.blocks, [seq.pages for seq in self.engine.scheduler.running])

    async def idle(self) -> None:
        for _ in range(400):
            if self.engine.active == 0 and self.engine.waiting == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the engine did not go idle")


def engine_config(tmp_path, redis_url: str | None = None, **overrides) -> EngineConfig:
    cache = {}
    if redis_url:
        # No load deadline: a slow volume falling back to recompute is the fault tests' (test_faults.py); here a
        # read slowed by a busy machine (a first read of 2 blocks took over 0.64 s in a CI run) must not turn
        # a disk hit into a recompute.
        cache = {"redis_url": redis_url, "volumes": [str(tmp_path / "v0"), str(tmp_path / "v1")],
                 "index_prefix": f"batching{abs(hash(tmp_path)) % 10**8}", "mac_key": "batching-test-mac-key",
                 "prefetch_deadline_factor": 1e6}
    return EngineConfig(**({"pool_tokens": 64 * 400, "heartbeat_s": 0.2} | cache | overrides))


def runner(model, cfg, dtype: str, pages: int = 64, page: int = 64, backend: str = "auto", form: str = "auto",
           backend_options: dict | None = None, **options) -> Runner:
    """A runner of `model` (served at `dtype`) over a pool of its own."""
    chosen = make_backend(backend, cfg, "cpu", dtype, page_tokens=page, **(backend_options or {}))
    return Runner(model, cfg, LatentPool(cfg, pages, page), chosen, form=form, **options)


def logits_of(run: Runner, segments: list[Segment]) -> np.ndarray:
    return np.asarray(run.prefill(segments).run())


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 5e-3)])
@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_paged_steps_match_the_reference_on_a_fixed_schedule(tiny, dtype, tolerance, backend):
    """Ragged decode batches over pages give the reference forward's logits over the same served model: within fp32
    tolerance served in float32 (float32 decode attention), within bf16's served in bfloat16 (cache-dtype attention
    products); with decode attention by the cpu backend (its kernel reading the pages in place) and by xla's
    (pages read through the tables a key block at a time) alike."""
    cfg = tiny.config
    served = serving_model(tiny.model, dtype)
    paged = runner(served, cfg, dtype, backend=backend, chunk_tokens=64)
    assert paged.backend.decode_dtype == dtype  # derived from the served model
    lengths, tables = [70, 200, 5], [[3, 9], [4, 7, 12, 1], [2]]
    prompts = [prompt(10 + i, n) for i, n in enumerate(lengths)]
    fed = []
    for p, table in zip(prompts, tables):
        cut = len(p) // 2  # two segments, the second over the first's pages
        paged.prefill([Segment(p[:cut], 0, table)], want_logits=False).run()
        logits = logits_of(paged, [Segment(p[cut:], cut, table)])[0]
        want = reference.prompt_logits(served, p)[-1]
        np.testing.assert_allclose(logits, want, atol=1e-4 * np.abs(want).max())
        fed.append(int(np.argmax(logits)))
    contexts = [list(p) for p in prompts]
    for _ in range(3):  # three decode steps with every sequence in one batch
        rows = [DecodeRow(t, len(c), table) for t, c, table in zip(fed, contexts, tables)]
        batch = np.asarray(paged.decode(rows))
        for i, (t, c) in enumerate(zip(fed, contexts)):
            c.append(t)
            want = reference.prompt_logits(served, c)[-1]
            np.testing.assert_allclose(batch[i], want, atol=tolerance * np.abs(want).max())
        fed = [int(np.argmax(row)) for row in batch[:len(fed)]]


def test_view_buckets_are_powers_of_two_for_prefill_and_finer_for_decode():
    """Prefill views: powers of two up to 4K, quarters of one beyond (at most 2x masked rows, which its
    blockwise attention mostly skips); decode cost buckets, whose rows every step reads: eighths past 512."""
    lengths = (1, 256, 257, 512, 513, 700, 1025, 1500, 2049, 4096, 4097, 16385)
    assert [view_bucket(n, 64) for n in lengths] == [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096,
                                                     6144, 24576]
    decode = [view_bucket(n, 64, DECODE_VIEW_STEPS) for n in lengths]
    assert decode == [256, 256, 512, 512, 640, 768, 1280, 1536, 2560, 4096, 5120, 20480]
    assert all(n <= v <= 1.25 * n for n, v in zip(lengths, decode) if n > 512) and all(v % 64 == 0 for v in decode)


def test_a_segments_last_chunk_is_cut_to_its_rest_in_whole_pages_and_matches_the_reference(tiny):
    """Runner.prefill of one segment: chunks of the budget's size, the last one cut to the rest (a power of two up
    to a page, whole pages beyond), not padded to a power of two; the logits are the reference's either way."""
    cfg = tiny.config
    served = serving_model(tiny.model, "float32")
    paged = runner(served, cfg, "float32", pages=32, chunk_tokens=256)
    assert [paged.chunk_sizes(n, n) for n in (1, 20, 64, 190, 300, 600)] == [
        [1], [32], [64], [192], [256, 64], [256, 256, 128]]
    for i, (n, table) in enumerate([(300, [1, 2, 3, 4, 5]), (190, [6, 7, 8, 9])]):
        p = prompt(80 + i, n)
        want = reference.prompt_logits(served, p)[-1]
        np.testing.assert_allclose(logits_of(paged, [Segment(p, 0, table)])[0], want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_one_prefill_pass_of_several_sequences_matches_each_computed_alone(tiny, backend):
    """A pass of segments of several sequences (lengths that fill tiles partly, positions after a prefix already in
    their pages) gives each one's logits and latents as computed alone (served in float32: within fp32 tolerance),
    so decoding after either goes the same way."""
    cfg = tiny.config
    served = serving_model(tiny.model, "float32")
    specs = [(150, 0), (20, 64), (64, 130), (1, 300), (90, 10)]  # (segment tokens, start): 3+1+1+1+2 tiles
    prompts = [prompt(40 + i, start + n) for i, (n, start) in enumerate(specs)]
    tables = [list(range(1 + 6 * i, 7 + 6 * i)) for i in range(len(specs))]
    results = {}
    for how in ("alone", "pass"):
        paged = runner(served, cfg, "float32", backend=backend, chunk_tokens=64)
        for p, (n, start), table in zip(prompts, specs, tables):
            if start:
                paged.prefill([Segment(p[:start], 0, table)], want_logits=False).run()
        segments = [Segment(p[start:], start, table) for p, (n, start), table in zip(prompts, specs, tables)]
        if how == "alone":
            logits = [logits_of(paged, [segment])[0] for segment in segments]
        else:
            assert all(paged.batchable(n, start + n) for n, start in specs)
            out = logits_of(paged, segments)
            assert out.shape == (8, cfg.vocab_size)  # padded to a power of two of segments
            logits = list(out[:len(specs)])
        latents = [np.asarray(paged.pool.host(read))[:start + n]
                   for (n, start), table in zip(specs, tables) for read in paged.pool.read(table)]
        steps = np.asarray(paged.decode([DecodeRow(int(np.argmax(row)), start + n, table)
                                         for row, (n, start), table in zip(logits, specs, tables)]))
        results[how] = logits, latents, steps[:len(specs)]
    (alone, alone_latents, alone_steps), (batched, batched_latents, batched_steps) = results["alone"], results["pass"]
    for want, got in zip(alone, batched):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    for want, got in zip(alone_latents, batched_latents):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-2 * np.abs(want).max())
    np.testing.assert_allclose(batched_steps, alone_steps, atol=1e-4 * np.abs(alone_steps).max())
    with pytest.raises(ValueError, match="tiles do not fit one pass"):
        paged.prefill([Segment(prompt(1, 192), 0, [1, 2, 3])] * 3)
    assert not paged.batchable(256, 256)  # a long segment computes alone (faster there)


def amx_backend_options() -> dict:
    from model import cpu_kernels
    if not cpu_kernels.prefill_attention_available():
        pytest.skip("the prefill attention kernel needs AMX")
    return {}


@pytest.mark.parametrize("page", [16, 64])
def test_the_cpu_kernels_in_the_runner_match_xlas_path_alone_and_in_one_pass(page):
    """Latent widths our prefill attention kernel takes (tiny's 48 is not). Pages of 64 tokens: the cpu backend's
    kernel reads the pages in place, a pass's tiles in one call; of 16 it cannot (xla's form over gathered views).
    Logits alone and in one pass, and the next decode step, within bfloat16 tolerance of the xla backend."""
    amx_backend_options()
    cfg = preset("tiny", kv_lora_rank=64, qk_rope_head_dim=32)
    checkpoint = init_model(cfg)
    models = {"cpu": serving_model(checkpoint, "bfloat16"),
              "xla": serving_model(checkpoint, "bfloat16", few_row_kernel=False)}
    specs = [(40, 0), (20, 48), (16, 100)]  # (segment tokens, start)
    prompts = [prompt(60 + i, start + n) for i, (n, start) in enumerate(specs)]
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(len(specs))]
    out = {}
    for name, model in models.items():
        paged = runner(model, cfg, "bfloat16", pages=40, page=page, backend=name, chunk_tokens=64)
        assert getattr(paged.backend, "prefill_kernel", False) == (name == "cpu" and page == 64)
        for p, (n, start), table in zip(prompts, specs, tables):
            if start:
                paged.prefill([Segment(p[:start], 0, table)], want_logits=False).run()
        segments = [Segment(p[start:], start, table) for p, (n, start), table in zip(prompts, specs, tables)]
        alone = [logits_of(paged, [segment])[0] for segment in segments]
        together = logits_of(paged, segments)[:len(specs)]
        step = np.asarray(paged.decode([DecodeRow(int(np.argmax(row)), start + n, table)
                                        for row, (n, start), table in zip(alone, specs, tables)]))[:len(specs)]
        out[name] = np.stack(alone), together, step
    for got, want in zip(out["cpu"], out["xla"]):
        np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max())


def test_prefill_reading_pages_in_place_gives_the_logits_of_gathered_views():
    """The same model and pool, prefill attention read in place by the cpu backend's kernel (the default on a CPU
    with AMX) against xla's form over gathered views (the kernel off): a sequence's segment of several chunks (a
    table wider than its valid rows), a one-token segment, and a pass of several sequences' segments."""
    amx_backend_options()
    cfg = preset("tiny", kv_lora_rank=64, qk_rope_head_dim=32)
    model = serving_model(init_model(cfg), "bfloat16")
    runners = {"pages": runner(model, cfg, "bfloat16", backend="cpu", chunk_tokens=64),
               "views": runner(model, cfg, "bfloat16", backend="cpu", chunk_tokens=64,
                               backend_options={"prefill_kernel": False})}
    runners["views"].pool = runners["pages"].pool  # each writes the same latents into the same pages
    p = prompt(7, 700)
    out = {}
    for name, paged in runners.items():
        paged.prefill([Segment(p[:100], 0, list(range(1, 13)))], want_logits=False).run()
        long = logits_of(paged, [Segment(p[100:400], 100, list(range(1, 13)))])  # chunks of 64 up to 400
        one = logits_of(paged, [Segment(p[400:401], 400, list(range(1, 13)))])
        segments = [Segment(p[401:441], 401, list(range(1, 13))), Segment(p[:50], 0, list(range(20, 22)))]
        out[name] = [long, one, logits_of(paged, segments)[:2]]
    for got, want in zip(out["pages"], out["views"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="prefill kernel was asked for"):
        make_backend("cpu", cfg, "cpu", "bfloat16", page_tokens=16, prefill_kernel=True)


def run_passes(paged: Runner, passes, table_d: list[int], sliced: bool) -> tuple[list, list]:
    """Each pass run whole then as many decode steps of another sequence as it has units, or a unit at a time with
    a decode step after each: (each pass's result, the decode steps' logits)."""
    results, steps, position = [], [], 100
    for run in passes:
        units = run.units
        while run.done < units:
            run.step()
            if sliced:
                steps.append(np.asarray(paged.decode([DecodeRow(5, position, table_d)])))
                position += 1
        results.append(np.asarray(run.result))
        if not sliced:
            for _ in range(units):
                steps.append(np.asarray(paged.decode([DecodeRow(5, position, table_d)])))
                position += 1
    return results, steps


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_a_prefill_pass_sliced_by_layers_between_decode_steps_gives_the_same_bits(tiny, dtype, backend):
    """A pass run a unit at a time (a layer's chunk; a layer of a pass of several segments) with another sequence's
    decode step dispatched after every unit, as the engine slices a long-context pass between steps, against the
    pass run whole and as many decode steps after it: the same logits and latents, bit for bit."""
    cfg = tiny.config
    served = serving_model(tiny.model, dtype)
    p, q, d = prompt(60, 300), prompt(61, 90), prompt(62, 100)
    table_p, table_q, table_d = list(range(1, 7)), list(range(7, 9)), list(range(9, 12))
    out = {}
    for how in ("whole", "sliced"):
        paged = runner(served, cfg, dtype, pages=16, backend=backend, chunk_tokens=64)
        paged.prefill([Segment(p[:64], 0, table_p)], want_logits=False).run()
        paged.prefill([Segment(d, 0, table_d)], want_logits=False).run()
        passes = [paged.prefill([Segment(p[64:], 64, table_p)]),  # four chunks
                  paged.prefill([Segment(p[:40], 0, table_q), Segment(q[:90], 0, [13, 14])])]
        assert passes[0].units == cfg.num_layers * (4 + paged._form(236, 300).context_unit)
        assert passes[1].units == cfg.num_layers * (1 + paged.backend.prefill_form(64, 256, "auto", 3).context_unit)
        results, steps = run_passes(paged, passes, table_d, how == "sliced")
        latents = [np.asarray(paged.pool.host(read)) for table in (table_p, table_q, [13, 14], table_d)
                   for read in paged.pool.read(table)]
        out[how] = results, steps, latents
    for got, want in zip(*(out[how] for how in ("sliced", "whole"))):
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


def run_whole_and_sliced(cfg, checkpoint, form: str, kernel: bool) -> dict:
    """A 336-token segment at 64-400 run whole, and a unit at a time with another sequence's decode step after
    each unit (the same count of decode steps after the whole pass): each run's logits, decode steps and latents."""
    p, d = prompt(80, 400), prompt(81, 100)
    table_p, table_d = list(range(1, 8)), list(range(9, 11))
    out = {}
    for how in ("whole", "sliced"):
        model = serving_model(checkpoint, "bfloat16")
        paged = runner(model, cfg, "bfloat16", pages=16, backend="cpu", form=form, chunk_tokens=64,
                       backend_options={"prefill_kernel": kernel})
        paged.prefill([Segment(p[:64], 0, table_p)], want_logits=False).run()
        paged.prefill([Segment(d, 0, table_d)], want_logits=False).run()
        run = paged.prefill([Segment(p[64:], 64, table_p)])
        # 336 tokens: 5 chunks of 64, 16; in the expanded form one more unit per layer (its keys and values)
        assert run.units == cfg.num_layers * (6 + (form == "expanded"))
        (logits,), steps = run_passes(paged, [run], table_d, how == "sliced")
        latents = [np.asarray(paged.pool.host(read)) for table in (table_p, table_d) for read in paged.pool.read(table)]
        out[how] = logits, steps, latents
    (logits, steps, latents), (want_logits, want_steps, want_latents) = out["sliced"], out["whole"]
    assert np.array_equal(logits, want_logits) and len(steps) == len(want_steps)
    assert all(np.array_equal(g, w) for g, w in zip(steps + latents, want_steps + want_latents))
    return out


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_a_kernel_pass_in_place_is_sliced_by_chunks_and_matches_xlas_path(form):
    """With the CPU's prefill kernel reading the pages in place (widths it takes in both forms), a segment's units
    are its chunks of every layer, and in the expanded form each layer's keys and values: run a unit at a time with
    another sequence's decode step after each, its logits and latents are bit for bit those of the pass run whole;
    and within bfloat16 tolerance of xla's path (the kernel off) in the same form."""
    amx_backend_options()
    cfg = preset("tiny", kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
    checkpoint = init_model(cfg)
    kernel, xla = run_whole_and_sliced(cfg, checkpoint, form, True), run_whole_and_sliced(cfg, checkpoint, form, False)
    np.testing.assert_allclose(kernel["whole"][0], xla["whole"][0], atol=3e-2 * np.abs(xla["whole"][0]).max())


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_a_pass_over_gathered_views_is_sliced_by_chunks_too(form):
    """Without the prefill kernel (a CPU without AMX, or a GPU/TPU) attention reads a view gathered once per layer;
    its units are still the layer's chunks (and the expanded form's keys and values): a slice of a long prefill is
    a chunk, not a whole layer of the segment. Run a unit at a time between decode steps, it is bit for bit the
    pass run whole."""
    cfg = preset("tiny", kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
    run_whole_and_sliced(cfg, init_model(cfg), form, False)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_a_sequences_segments_in_either_form_give_the_logits_of_one_pass(tiny, dtype, tolerance):
    """A prompt computed as segments of both attention forms (each reading what the ones before wrote into its
    pages) gives the logits of the prompt in one pass, expanded or absorbed, and of the reference forward."""
    cfg = tiny.config
    p, table = prompt(90, 700), list(range(1, 13))
    cuts = [(0, 130, "expanded"), (130, 300, "expanded"), (300, 340, "absorbed"), (340, 520, "expanded"),
            (520, 700, "expanded")]
    served = serving_model(tiny.model, dtype)
    runs = {}
    for form in ("expanded", "absorbed"):
        runs[f"one pass, {form}"] = logits_of(runner(served, cfg, dtype, pages=16, form=form, chunk_tokens=128),
                                              [Segment(p, 0, table)])[0]
    paged = runner(served, cfg, dtype, pages=16, chunk_tokens=128)
    for start, end, form in cuts:
        paged.form = form
        assert paged._form(end - start, end).name == form
        logits = paged.prefill([Segment(p[start:end], start, table)], want_logits=end == len(p)).run()
    runs["segments"] = np.asarray(logits)[0]
    want = reference.prompt_logits(served, p)[-1]
    for how, got in runs.items():
        np.testing.assert_allclose(got, want, atol=tolerance * np.abs(want).max(), err_msg=how)


async def test_a_sliced_pass_finishes_over_steps_and_closes_when_its_sequence_is_cancelled_or_preempted(tiny, tmp_path):
    """Engine plans executed by hand (no model thread): a segment given a budget smaller than one unit's cost runs
    one unit (a layer's chunk) a step and stays in flight; finished that way, its first token and logits are those
    of the same segment run whole. Cancelled mid-pass, or preempted by a decoding sequence that needs a page, it
    closes the pass: no unit more is dispatched, nothing is counted computed, every page is free or owned once."""
    cfg = engine_config(tmp_path, pool_tokens=64 * 16)
    loaded = tiny
    L = loaded.config.num_layers

    def engine() -> Engine:
        e = Engine(loaded, cfg, CacheLink(cfg, CacheGeometry(L, loaded.config.latent_dim, 64, loaded.config.cache_dtype),
                                          loaded.fingerprint), EngineMetrics())
        e.warm_up()  # seeds the prefill cost: a sliced pass predicts its units' time from it
        e.loop = asyncio.get_running_loop()
        return e

    def admitted(e: Engine, tokens: np.ndarray) -> Sequence:
        job = Job(f"r{id(tokens)}", np.asarray(tokens, np.int64), "t", SALT, miss(), SamplingParams(max_tokens=4),
                  "chat", True)
        seq = Sequence(job, 0, asyncio.Queue(), e.loop, tokens=[int(t) for t in tokens], hashes=[])
        e._count(waiting=1)
        e.scheduler.add(seq)
        for admitted_seq, memory in e.scheduler.admit():
            e._admitted(admitted_seq, memory)
        assert seq.status is Status.RUNNING
        return seq

    async def first_token(seq: Sequence) -> dict:
        await asyncio.sleep(0)
        events = []
        while not seq.events.empty():
            events.append(seq.events.get_nowait())
        return next(event for event in events if event["type"] == "token")

    long = prompt(70, 300)
    whole = engine()
    seq = admitted(whole, long)
    whole._execute(Plan([], [[(seq, 300)]]))
    want = await first_token(seq)

    e = engine()
    slices = e.metrics.prefill_slices
    seq = admitted(e, long)
    e._execute(Plan([], [], (seq, 300), slice_s=1e-9))
    units = e.passes.flights[0].run.units
    assert units >= L and len(e.passes.flights) == 1 and slices._value.get() == 1 and seq.computed == 0
    for _ in range(units - 1):  # one unit a step; the head goes with the last
        assert e.passes.flights
        e._execute(Plan([], [], slice_s=1e-9))
    assert not e.passes.flights and slices._value.get() == units and seq.computed == 300
    assert await first_token(seq) == want  # the same token, and the same logits' digest

    e = engine()  # a short prompt's segment runs whole beside the sliced pass: its first token comes at once
    seq, short = admitted(e, long), admitted(e, prompt(72, 40))
    e._execute(Plan([], [[(short, 40)]], (seq, 300), slice_s=1e-9))
    assert e.passes.flights and short.computed == 40 and short.generated == 1 and seq.computed == 0
    while e.passes.flights:
        e._execute(Plan([], [], slice_s=1e-9))
    assert seq.computed == 300 and seq.generated == 1

    e = engine()
    seq = admitted(e, long)
    e._execute(Plan([], [], (seq, 300), slice_s=1e-9))
    assert e.passes.flights  # one unit in
    e._cancel(seq)
    assert not e.passes.flights and e.metrics.prefill_aborted._value.get() == 1
    assert seq.computed == 0 and e.metrics.prefill_tokens.labels("computed")._value.get() == 0
    assert e.blocks.owned_pages == 0
    check_pages(e.blocks, [])

    e = engine()
    decoding = admitted(e, prompt(71, 63))  # its second token needs a second page
    e._execute(Plan([], [[(decoding, 63)]]))
    e._execute(e.scheduler.schedule())  # its first decode step
    seq = admitted(e, long)
    e._execute(Plan([], [], (seq, 300), slice_s=1e-9))
    assert e.passes.flights
    filler = e.blocks.allocate(e.blocks.available())  # the pool is full: the youngest (in the pass) is preempted
    plan = e.scheduler.schedule(None, [seq], slicing=True)
    assert plan.preempted == (seq,) and plan.decoding == [decoding]
    e._execute(plan._replace(slice_s=1e-9))
    assert not e.passes.flights and e.metrics.prefill_aborted._value.get() == 1
    assert e.metrics.preemptions._value.get() == 1
    assert seq.status is Status.WAITING and seq.computed == 0 and not seq.pages
    assert decoding.computed == 65 and len(decoding.pages) == 2
    e.blocks.release(filler)
    check_pages(e.blocks, [decoding.pages])


@pytest.mark.parametrize("dtype, path, tolerance", [("bfloat16", "auto", 3e-2), ("float32", "float32", 1e-4)])
def test_decode_attention_takes_the_kernel_path_of_the_serving_dtype_and_matches_xla(dtype, path, tolerance):
    """Pages of 64 tokens at widths in whole 32s: bfloat16 serving takes the kernel's best path (AMX where the CPU
    has it: queries and weights rounded to bfloat16, as xla's path rounds them), float32 serving its float32 path,
    whose logits agree with the xla backend's to float32 rounding."""
    cfg = preset("tiny", kv_lora_rank=64, qk_rope_head_dim=32)
    model = serving_model(init_model(cfg), dtype)
    specs = [(70, 0), (130, 1), (200, 2)]  # (context, sequence)
    logits = {}
    for backend in ("cpu", "xla"):
        paged = runner(model, cfg, dtype, pages=16, backend=backend, backend_options={"decode_kernel": True}
                       if backend == "cpu" else None)
        assert backend == "xla" or paged.backend.decode_path == path
        tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(specs))]
        for context, i in specs:
            paged.prefill([Segment(prompt(80 + i, context), 0, tables[i])], want_logits=False).run()
        logits[backend] = np.asarray(paged.decode([DecodeRow(5 + i, context, tables[i]) for context, i in specs]))
    want = logits["xla"][:len(specs)]
    np.testing.assert_allclose(logits["cpu"][:len(specs)], want, atol=tolerance * np.abs(want).max())


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_a_steps_short_segments_share_passes_by_context_and_long_ones_go_alone(tiny, invariant):
    """The plan's passes: short segments packed in order of where they end, up to MAX_PASS_TILES tiles a pass (a
    pass's tiles all loop over as many key blocks as its longest one's); a segment too long to batch, or of a
    sequence loading a disk hit, alone; every segment in exactly one pass. In batch-invariant mode every segment
    goes alone, in order."""
    shapes = runner(serving_model(tiny.model, "float32"), tiny.config, "float32", pages=8)
    scheduler = Scheduler(BlockManager(8, 64, ""), SchedulePolicy(64, 8, 256, 2048, invariant, 2.0), shapes)
    ends = [1900, 100, 1500, 300, 700, 64, 1200, 900, 2000, 500]
    segments = [(Sequence(None, 0, None, None, computed=end - 64), 64) for end in ends]
    segments.insert(3, (Sequence(None, 0, None, None, computed=100), 512))  # too long to batch
    loading = Sequence(None, 0, None, None, computed=640)
    loading.load = object()  # (a disk hit being read)
    segments.append((loading, 64))
    passes = scheduler._passes(segments)
    assert sorted(id(seq) for group in passes for seq, _ in group) == sorted(id(seq) for seq, _ in segments)
    if invariant:
        assert passes == [[item] for item in segments]
        return
    assert passes[-2:] == [[segments[3]], [segments[-1]]] and all(len(group) <= MAX_PASS_TILES for group in passes)
    packed = [seq.computed + n for group in passes[:-2] for seq, n in group]
    assert packed == sorted(ends) and [len(group) for group in passes[:-2]] == [8, 2]


@pytest.mark.parametrize("kind", ["miss", "memory", "disk"])
async def test_batch_invariant_logits_are_bit_identical_alone_or_among_16(tiny, tmp_path, valkey_server, kind):
    cfg = engine_config(tmp_path, valkey_server.connection_url, batch_invariant=True, max_batch=16,
                        step_tokens=64, solo_tokens=64)
    lengths = [70 + 37 * i for i in range(16)]
    prompts = [prompt(100 + i, n) for i, n in enumerate(lengths)]
    async with Running(tiny, cfg) as run:
        if kind != "miss":  # every prompt computed once: its blocks are then in memory and on disk
            for p in prompts:
                await run.generate(run.job(p, max_tokens=1, digest=False))

        async def job(p):
            if kind != "memory":
                await run.engine.drop_memory_tier()
            return run.job(p, hit=await run.hit(p) if kind == "disk" else None)

        alone = []
        for p in prompts:
            alone.append(await run.generate(await job(p)))
        jobs = [await job(p) for p in prompts]
        together = await asyncio.gather(*(run.generate(j) for j in jobs))
        await run.idle()
        run.check_pages()
    for (ids_a, sha_a, done_a), (ids_b, sha_b, done_b) in zip(alone, together):
        assert ids_a == ids_b and sha_a == sha_b and None not in sha_a
        assert done_a["tiers"] == done_b["tiers"]
        tier_tokens = done_a["tiers"]["memory" if kind == "memory" else "disk"]
        assert (tier_tokens > 0) == (kind != "miss"), done_a


async def test_a_preempted_sequence_gives_the_same_tokens(tiny, tmp_path):
    prompts = [prompt(200 + i, 100) for i in range(4)]
    async with Running(tiny, engine_config(tmp_path, pool_tokens=64 * 40)) as run:
        alone = [(await run.generate(run.job(p, max_tokens=40)))[0] for p in prompts]
    # 11 pages: four sequences of 100 + 40 tokens need 12, so the youngest is preempted and resumed.
    async with Running(tiny, engine_config(tmp_path, pool_tokens=64 * 10, max_batch=4)) as run:
        together = await asyncio.gather(*(run.generate(run.job(p, max_tokens=40)) for p in prompts))
        await run.idle()
        run.check_pages()
        assert run.metrics.preemptions._value.get() >= 1
    assert [ids for ids, _, _ in together] == alone


async def test_a_long_prefill_interleaves_with_other_streams_decoding(tiny, tmp_path):
    cfg = engine_config(tmp_path, step_tokens=32, solo_tokens=32)
    async with Running(tiny, cfg) as run:
        got: dict[str, list] = {"a": [], "b": []}
        long_first_token = asyncio.Event()

        async def stream(name, p):  # decodes far longer than the long prefill lasts; cancelled after it
            async for event in run.engine.run(run.job(p, max_tokens=5000, digest=False)):
                if event["type"] == "token":
                    got[name].append(long_first_token.is_set())

        streams = [asyncio.create_task(stream(n, prompt(300 + i, 20))) for i, n in enumerate(got)]
        while not all(got.values()):
            await asyncio.sleep(0.01)
        before = sum(len(v) for v in got.values())
        ids = []
        async for event in run.engine.run(run.job(prompt(399, 1200), max_tokens=2, digest=False)):
            if event["type"] == "token":
                if not ids:
                    during = sum(len(v) for v in got.values()) - before
                    long_first_token.set()
                ids.append(event["id"])
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await run.idle()
        run.check_pages()
    # 1,200 prompt tokens in 32-token steps (minus two decode tokens each): ~40 steps, each decoding both.
    assert len(ids) == 2 and during >= 2 * 30, during


async def test_a_disconnect_mid_prefill_frees_its_pages_and_computes_nothing_more(tiny, tmp_path, valkey_server):
    cfg = engine_config(tmp_path, valkey_server.connection_url, step_tokens=32, solo_tokens=32)
    async with Running(tiny, cfg) as run:
        computed = run.metrics.prefill_tokens.labels("computed")
        events = run.engine.run(run.job(prompt(400, 8000), max_tokens=4, digest=False))
        assert (await anext(events))["type"] == "progress"
        while computed._value.get() < 200:  # its prefill is under way (250 steps of 32 tokens in all)
            await asyncio.sleep(0.005)
        await events.aclose()
        await run.idle()
        stopped_at = computed._value.get()
        await asyncio.sleep(0.3)
        assert computed._value.get() == stopped_at < 8000
        assert run.metrics.requests.labels("cancelled")._value.get() == 1
        assert run.engine.blocks.owned_pages == 0
        run.check_pages()
        # A disk hit cancelled while it loads reads nothing more and recomputes nothing.
        p = prompt(401, 640)
        await run.generate(run.job(p, max_tokens=1, digest=False))
        await run.engine.drop_memory_tier()
        hit = await run.hit(p)
        before = computed._value.get()
        events = run.engine.run(run.job(p, hit=hit, digest=False))
        await anext(events)
        await events.aclose()
        await run.idle()
        await asyncio.sleep(0.3)
        assert computed._value.get() == before
        assert sum(run.metrics.cache_fallbacks.labels(r)._value.get() for r in ("deadline", "verification")) == 0
        run.check_pages()


async def test_pool_accounting_after_a_mix_of_requests_cancellations_and_preemptions(tiny, tmp_path):
    rng = np.random.default_rng(7)
    # 11 usable pages; six growers need 2 each to start and 4 each by their end: preemption is certain.
    async with Running(tiny, engine_config(tmp_path, pool_tokens=64 * 11, max_batch=6, step_tokens=48)) as run:
        shared = prompt(500, 130)

        async def one(i):
            if i < 6:
                p, max_tokens = prompt(700 + i, 100), 120
            else:
                p = np.concatenate([shared, prompt(600 + i, int(rng.integers(1, 120)))]) if i % 2 else prompt(600 + i, 90)
                max_tokens = int(rng.integers(1, 60))
            events = run.engine.run(run.job(p, max_tokens=max_tokens, digest=False))
            async for event in events:
                if i % 5 == 4 and event["type"] == "token":
                    await events.aclose()  # a client that goes away mid-answer
                    return

        await asyncio.gather(*(one(i) for i in range(24)))
        await run.idle()
        run.check_pages()
        assert run.engine.blocks.owned_pages == 0
        assert run.metrics.preemptions._value.get() >= 1
        assert run.metrics.prefix_hit_tokens.labels("memory")._value.get() > 0


async def test_an_answer_that_outgrows_the_pool_is_cut_with_length_not_refused(tiny, tmp_path):
    """Prompt + max_tokens larger than the whole pool: admitted, answered until its pages fill the pool,
    finished with "length"; a prompt that alone does not fit is refused (TooLarge)."""
    cfg = engine_config(tmp_path, pool_tokens=64 * 5, max_batch=2)
    async with Running(tiny, cfg) as run:
        usable = run.engine.blocks.usable * cfg.block_tokens
        ids, _, done = await run.generate(run.job(prompt(7, usable - 20), max_tokens=500, digest=False))
        # every pool slot holds a latent (the prompt's and 20 answer tokens'); the 21st token needs none
        assert done["finish_reason"] == "length" and len(ids) == 21, (len(ids), done)
        with pytest.raises(ValueError, match="does not fit"):
            run.engine.check(run.job(prompt(8, usable + 1), max_tokens=1))
        await run.idle()
        run.check_pages()


@pytest.mark.parametrize("rows", [1, 16, 40])
def test_decodes_absorbed_products_per_head_take_the_few_row_kernel_where_the_rows_allow(rows):
    """W_UK and W_UV per head (mini's widths), as a decode step calls them: by the cpu backend's few-row kernel up to
    its rows (32 with AMX, AVX-512 or AVX2), past them by XLA with the same rounding of the rows to bfloat16; both
    the float64 product of the rounded rows within float32 summation. Without the kernel, XLA's float32 product of
    the rows as given."""
    import jax.numpy as jnp
    from model import cpu_kernels
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((8, rows, 128)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((8, 512, 128)), jnp.bfloat16)
    rounded = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
    want = np.einsum("nbi,noi->nbo", rounded, np.asarray(w, np.float64))
    cfg = preset("mini")
    if cpu_kernels.available("cpu")[0]:
        got = np.asarray(make_backend("cpu", cfg, "cpu", "bfloat16", few_rows=True).per_head(jnp.asarray(x), w))
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    exact = np.einsum("nbi,noi->nbo", x.astype(np.float64), np.asarray(w, np.float64))
    plain = make_backend("cpu", cfg, "cpu", "bfloat16", few_rows=False, decode_kernel=False)
    got = np.asarray(plain.per_head(jnp.asarray(x), w.astype(jnp.float32)))
    np.testing.assert_allclose(got, exact, atol=1e-5 * np.abs(exact).max(), rtol=0)
    assert not np.allclose(exact, want, atol=1e-5 * np.abs(exact).max(), rtol=0)  # the rounding shows


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_mini_decode_is_batch_invariant_and_matches_the_reference(backend):
    """The mini preset's real widths (8 heads, 512 + 64 latent, 129K vocab), in-process, on each backend (both
    claim batch invariance): in batch-invariant mode a sequence's decode logits are bit-identical alone or among
    15 others of different lengths; and they agree with the reference forward over the same bfloat16-served
    model."""
    cfg = preset("mini")
    model = serving_model(init_model(cfg), "bfloat16")  # as the engine serves it
    lengths = [40 + 23 * i for i in range(16)]
    tables = [list(range(1 + 7 * i, 8 + 7 * i)) for i in range(16)]  # 7 pages = 448 tokens each
    invariant = runner(model, cfg, "bfloat16", pages=1 + 7 * 16, backend=backend, fixed_batch=16)
    assert invariant.backend.batch_invariant
    prompts = [prompt(300 + i, n) for i, n in enumerate(lengths)]
    firsts = [int(np.argmax(logits_of(invariant, [Segment(p, 0, t)])[0])) for p, t in zip(prompts, tables)]
    rows = [DecodeRow(tok, n, t) for tok, n, t in zip(firsts, lengths, tables)]
    together = np.asarray(invariant.decode(rows))
    for i in (0, 7, 15):
        alone = np.asarray(invariant.decode([rows[i]]))[0]
        assert np.array_equal(alone, together[i]), f"row {i}: logits differ alone vs among 16"
    for i in (0, 15):
        want = reference.prompt_logits(model, np.append(prompts[i], firsts[i]))[-1]
        # bfloat16 serving rounds every projection's input to 8 bits, so a different summation order of
        # attention can flip roundings downstream: ~1% of the largest logit here (float32 serving: 1e-4).
        np.testing.assert_allclose(together[i], want, atol=2e-2 * np.abs(want).max())

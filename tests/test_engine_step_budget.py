"""Sizing prefill segments by time: the step cost model (fed chosen numbers, never timed here) and the
scheduler's choice of segment tokens while other sequences decode."""
import numpy as np
import pytest

from kvstore import miss
from model.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.block_manager import BlockManager
from services.engine.scheduler import SLICED_STEPS, SchedulePolicy, Scheduler, decode_cut
from services.engine.sequence import Job, Sequence
from services.engine.step_cost import DecodeCost, DispatchCost, PrefillCost, StepCost

A, B_CTX = 1e-4, 1e-8  # seconds per token, seconds per token per context token (about mini on a CPU)


def cost_of(n: int, end: int) -> float:
    return A * n + B_CTX * n * end


def measured(decode_s: float | None = 0.02) -> StepCost:
    """A cost model fed segments at short and long contexts (exactly `cost_of`) and decode steps."""
    cost = StepCost()
    for n, end in [(512, 512), (256, 768), (256, 4096), (128, 8192), (64, 16384), (128, 16448)]:
        cost.prefill.observe(n, end, cost_of(n, end))
    if decode_s is not None:
        for _ in range(3):
            cost.decode.observe(2, decode_s)
    return cost


def sequence(prompt: int, generated: int = 0) -> Sequence:
    job = Job(f"r{prompt}-{generated}", np.zeros(prompt, np.int64), "t", "5a" * 16, miss(),
              SamplingParams(max_tokens=100), "default")
    return Sequence(job, 0, None, None, tokens=[1] * (prompt + generated), generated=generated)


def scheduler(**policy) -> Scheduler:
    settings = {"block_tokens": 64, "max_batch": 8, "step_tokens": 256, "solo_tokens": 2048,
                "batch_invariant": False,
                "prefill_step_ratio": 2.0} | policy
    return Scheduler(BlockManager(2048, 64, ""), SchedulePolicy(**settings))


def running(s: Scheduler, *prefill: tuple[int, int], decoding: int = 2) -> list[Sequence]:
    """`decoding` sequences past their prefill, then one prefilling sequence per (prompt, computed)."""
    for i in range(decoding):
        s.add(sequence(20 + i, generated=1))
    for prompt, _ in prefill:
        s.add(sequence(prompt))
    for seq, _ in s.admit():
        seq.computed = seq.target if seq.generated else seq.computed
    seqs = [seq for seq in s.running if seq.generated == 0]
    for seq, (_, computed) in zip(seqs, prefill):
        seq.computed = computed
    return seqs


def test_the_prefill_fit_recovers_its_terms_from_segments_of_several_sizes_and_contexts():
    fit = measured().prefill
    assert fit.coef == pytest.approx({"a": A, "b": B_CTX, "c": 0, "d": 0}, rel=1e-6, abs=1e-12)
    assert fit.predict(256, 16384) == pytest.approx(cost_of(256, 16384))
    # With a per-segment view gather (c*end) and dispatch (d) as well:
    c, d = 2e-7, 3e-3
    with_view = PrefillCost()
    for n, end in [(512, 512), (64, 600), (256, 4096), (64, 4100), (128, 8192), (64, 16384), (256, 16448)]:
        with_view.observe(n, end, cost_of(n, end) + c * end + d)
    assert with_view.coef == pytest.approx({"a": A, "b": B_CTX, "c": c, "d": d}, rel=1e-5)
    assert with_view.summary() == {"seconds_per_token": with_view.coef["a"],
                                   "seconds_per_token_per_context_token": with_view.coef["b"],
                                   "seconds_per_context_token": with_view.coef["c"],
                                   "seconds_per_segment": with_view.coef["d"], "segments": 7}


def test_the_prefill_fit_puts_everything_on_tokens_until_contexts_differ_and_never_goes_negative():
    fit = PrefillCost()
    assert fit.predict(64, 64) is None
    fit.observe(512, 512, 0.05)
    fit.observe(256, 600, 0.025)  # the ends are too close to tell a context term: all on a
    assert fit.coef["b"] == fit.coef["c"] == fit.coef["d"] == 0 and fit.coef["a"] == pytest.approx(1e-4, rel=0.05)
    # Segments at long context measured faster than at short ones (noise): no negative term.
    fit.observe(64, 16384, 0.001)
    fit.observe(64, 8192, 0.002)
    assert min(fit.coef.values()) >= 0 and fit.predict(64, 16384) > 0
    fit.observe(0, 10, 1.0)  # says nothing: ignored
    fit.observe(10, 20, 0.0)
    assert len(fit.segments) == 4


def test_decode_cost_is_the_median_per_batch_bucket_so_a_compiling_step_does_not_count():
    decode = DecodeCost()
    assert decode.predict(4) is None
    for seconds in (3.0, 0.02, 0.021, 0.019):  # the first step of a shape compiled
        decode.observe(3, seconds)
    assert decode.predict(4) == pytest.approx(0.0205)  # 3 and 4 share the bucket of 4
    assert decode.predict(1) == pytest.approx(0.0205)  # nearest bucket seen
    decode.observe(16, 0.05)
    assert decode.predict(32) == 0.05 and decode.predict(8) == pytest.approx(0.0205)  # a tie: the smaller


def test_a_long_context_segment_gets_fewer_tokens_than_a_short_one():
    cost = measured(decode_s=0.02)  # a step's prefill gets about 2 x 0.02 s
    s = scheduler()
    short, long = running(s, (4000, 0), (20000, 16384))
    step = s.schedule(cost)
    assert len(step.decoding) == 2
    # At context 0, 256 tokens take 26 ms (512: 54 ms); at 16K, 128 take 34 ms (256: 67 ms). The long
    # one gets what is left of the 40 ms after the short one's 26: 64 tokens (17 ms) do not fit either.
    assert step.prefill == [(short, 256)]
    s2 = scheduler()
    long, = running(s2, (20000, 16384))
    assert s2.schedule(cost).prefill == [(long, 128)]
    assert all(cost.prefill_s(n, long.computed + n) <= 2 * 0.02 for _, n in s2.schedule(cost).prefill)


def test_a_segment_never_goes_below_one_block_however_cheap_decoding_is():
    cost = measured(decode_s=1e-6)
    s = scheduler()
    first, second = running(s, (20000, 16384), (3000, 0))
    step = s.schedule(cost)
    # Neither fits: the sliced pass goes to the one with less left to compute (3,000 tokens from 0 against the
    # older one's 3,616 at 16K); the other waits.
    assert step.prefill == [] and step.sliced == (second, 64)
    s2 = scheduler()
    tail, = running(s2, (16400, 16384))
    assert s2.schedule(cost).sliced == (tail, 16)  # the rest of a prompt, shorter than a block


def test_a_segment_never_goes_above_solo_tokens_however_slow_decoding_is():
    cost = measured(decode_s=100.0)
    s = scheduler(solo_tokens=1024)
    first, second = running(s, (20000, 0), (500, 0))
    assert s.schedule(cost).prefill == [(first, 1024), (second, 500)]
    s2 = scheduler(solo_tokens=1000)  # not a power of two times the block: the cap still holds
    only, = running(s2, (20000, 0))
    assert s2.schedule(cost).prefill == [(only, 1000)]


def test_a_segment_that_does_not_fit_a_step_is_sliced_and_sized_to_a_few_steps_budgets():
    cost = measured(decode_s=0.005)  # a step's prefill gets 2 x 5 ms
    s = scheduler()
    long, = running(s, (20000, 16384))
    step = s.schedule(cost)
    # At 16K one block takes 17 ms: none fits 10 ms. The pass is sized to SLICED_STEPS (32) budgets, 320 ms:
    # 1024 tokens (281 ms; 2048 take 582), computed a few units a step with the whole budget.
    assert step.prefill == [] and step.sliced == (long, 1024) and step.slice_s == pytest.approx(0.01)
    assert cost.prefill_s(1024, 16384 + 1024) <= SLICED_STEPS * 0.01 < cost.prefill_s(2048, 16384 + 2048)
    # A segment that fits is not sliced.
    s2 = scheduler()
    short, = running(s2, (3000, 0))
    step = s2.schedule(cost)
    assert step.sliced is None and step.slice_s is None and step.prefill == [(short, 64)]


def test_where_small_segments_pay_mostly_the_fixed_cost_a_long_prompt_takes_a_sliced_pass_instead():
    """A pass's fixed cost (all the weights read, every layer dispatched) makes the 64 tokens that fit a step
    cost about what hundreds do: a long prompt then gets a large segment as a sliced pass (SLICE_GAIN more tokens
    a second), not a small segment a step; a prompt whose rest fits a step is computed whole, and with no fixed
    cost small segments stay (the tests above)."""
    d = 0.03
    cost = StepCost()
    for n, end in [(512, 512), (256, 768), (64, 64), (256, 4096), (128, 8192), (64, 16384), (2048, 2048)]:
        cost.prefill.observe(n, end, cost_of(n, end) + d)
    for _ in range(3):
        cost.decode.observe(2, 0.02)  # a step's prefill gets 40 ms: 64 tokens at context 0 fit (36 ms), 128 do not
    assert cost.prefill.coef == pytest.approx({"a": A, "b": B_CTX, "c": 0.0, "d": d}, rel=1e-4, abs=1e-12)
    s = scheduler()
    long, = running(s, (16384, 0))
    step = s.schedule(cost)
    assert step.prefill == [] and step.sliced == (long, 2048) and step.slice_s == pytest.approx(0.04)
    s2 = scheduler()
    short, = running(s2, (64, 0))
    step = s2.schedule(cost)
    assert step.prefill == [(short, 64)] and step.sliced is None


def test_short_prompts_are_not_stuck_behind_a_sliced_pass():
    cost = measured(decode_s=0.005)
    s = scheduler()
    long, short, other_long = running(s, (20000, 16384), (3000, 0), (30000, 16384))
    budget = 2 * 0.005 * 3 / 2  # three prefilling behind two decoding: 1.5 shares of 10 ms
    # The long one (oldest) is sliced; the short one's largest fitting segment runs beside it, and the slice
    # gets what is left; the second long one waits (one sliced pass at a time).
    step = s.schedule(cost)
    (seq, n), = step.prefill
    assert seq is short and cost.prefill_s(n, n) <= budget < cost.prefill_s(2 * n, 2 * n)
    assert step.sliced[0] is long and step.slice_s == pytest.approx(budget - cost.prefill_s(n, n))
    # While the pass is in flight: no segment for its sequence, the short one goes on, the pass gets the rest.
    in_flight = s.schedule(cost, in_flight=[long], slicing=True)
    assert in_flight.prefill == [(short, n)] and in_flight.sliced is None and len(in_flight.decoding) == 2
    assert in_flight.slice_s == pytest.approx(budget - cost.prefill_s(n, n))
    # With no costs to size by, the pass in flight runs to its end before any other segment.
    untimed = s.schedule(None, in_flight=[long], slicing=True)
    assert untimed.prefill == [] and untimed.decoding == in_flight.decoding and untimed.sliced is None


def test_of_sequences_that_need_a_sliced_pass_the_one_with_least_left_gets_it():
    """A short prompt whose smallest segment does not fit a step waits for the long one's sliced pass in flight,
    then gets the next sliced pass before the long one (shortest remaining time first): taken by age, the long
    one's passes came one after another and the short prompt's first token after all of them (44-108 s behind a
    16K miss on a CPU without AMX)."""
    cost = measured(decode_s=0.002)  # a step's prefill gets 4 ms: 64 tokens take 6.4 ms at context 0
    s = scheduler()
    long, short = running(s, (20000, 16384), (3000, 0))
    # The short one's rest: 0.3 s; the long one's: 1.08 s. A pass is sized to 32 budgets (128 ms): 1,024 tokens.
    assert s.schedule(cost).sliced == (short, 1024)
    in_flight = s.schedule(cost, in_flight=[long], slicing=True)  # (as if the long one's pass were in flight)
    assert in_flight.prefill == [] and in_flight.sliced is None
    short.computed = 1024  # its pass done: the next one is still its own
    assert s.schedule(cost).sliced == (short, 1024)


def test_the_ratio_scales_the_segment():
    cost = measured(decode_s=0.02)
    sizes = []
    for ratio in (1.0, 2.0, 8.0):
        s = scheduler(prefill_step_ratio=ratio)
        seq, = running(s, (40000, 0))
        (_, n), = s.schedule(cost).prefill
        sizes.append(n)
    assert sizes == [128, 256, 1024]


def test_batch_invariant_cuts_ignore_the_costs():
    for cost in (None, measured(decode_s=1e-6), measured(decode_s=100.0)):
        s = scheduler(batch_invariant=True, step_tokens=256)
        first, second = running(s, (3000, 100), (3000, 0))
        # Segments end at the next multiple of step_tokens; the step's token budget (256 - 2 decode tokens)
        # is spent by the first, then the second's fixed 256.
        assert s.schedule(cost).prefill == [(first, 156), (second, 256)]


def test_without_decoding_or_without_measured_costs_the_token_budgets_apply():
    s = scheduler()
    alone, = running(s, (5000, 0), decoding=0)
    assert s.schedule(measured(decode_s=0.02)).prefill == [(alone, 2048)]  # solo_tokens
    s2 = scheduler()
    seq, = running(s2, (5000, 0))
    assert s2.schedule(measured(decode_s=None)).prefill == [(seq, 254)]  # step_tokens - 2 decode tokens
    assert s2.schedule(None).prefill == [(seq, 254)]


def test_a_ratio_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="prefill_step_ratio"):
        EngineConfig(prefill_step_ratio=0)
    with pytest.raises(ValueError, match="prefill_step_ratio"):
        SchedulePolicy(64, 8, 256, 2048, False, -1.0)


def test_a_pass_of_several_segments_pays_the_per_pass_cost_once():
    """Segments computed together in one pass (Runner.prefill of several) are fitted as their sum plus one
    d; segments measured alone and passes together recover the same terms."""
    c, d = 2e-7, 3e-3
    alone = lambda n, end: cost_of(n, end) + c * end  # noqa: E731 - the terms a segment brings to a pass
    fit = PrefillCost()
    for n, end in [(512, 512), (64, 600), (256, 4096), (128, 8192)]:
        fit.observe(n, end, alone(n, end) + d)
    for segments in ([(64, 64), (64, 128), (100, 900)], [(192, 192), (30, 3000)], [(64, 64)] * 8):
        fit.observe_pass(segments, sum(alone(n, end) for n, end in segments) + d)
    assert fit.coef == pytest.approx({"a": A, "b": B_CTX, "c": c, "d": d}, rel=1e-5)
    assert fit.per_pass_s == pytest.approx(d)
    fit.observe_pass([], 1.0)  # nothing computed, or a segment that makes no sense: ignored
    fit.observe_pass([(64, 64), (0, 10)], 1.0)
    assert len(fit.segments) == 7


def test_sequences_waiting_for_their_first_token_get_more_of_a_step_when_they_outnumber_the_decoding_ones():
    """While few sequences decode and many wait in prefill, pacing the prefills by one stream's decode time
    would leave the many waiting (64 tokens a step each): their share of the step grows with their number
    over the decoding ones; with no more prefilling than decoding sequences it stays prefill_step_ratio."""
    cost = measured(decode_s=0.02)
    budgets = []
    for decoding, prefilling in ((4, 1), (1, 4), (1, 8)):
        s = scheduler(max_batch=16)
        seqs = running(s, *[(4000, 0)] * prefilling, decoding=decoding)
        step = s.schedule(cost)
        assert len(step.decoding) == decoding and step.prefill[0][0] is seqs[0]
        budgets.append(sum(cost.prefill_s(n, seq.computed + n) for seq, n in step.prefill))
    assert budgets[0] <= 2 * 0.02 < budgets[1] <= 4 * 2 * 0.02 < budgets[2] <= 8 * 2 * 0.02
    assert budgets[2] > 4 * 2 * 0.02 * 0.75  # mostly spent, not a token budget in disguise


F, G, H = 0.035, 5e-6, 1e-3  # a decode dispatch: seconds fixed, per view row of each sequence, per sequence


def dispatch_cost() -> DispatchCost:
    """Fed exact dispatch times of several shapes (and a compiling first dispatch of one)."""
    cost = DispatchCost()
    cost.observe(16, 2048, 3.0)  # compiled: the shape's median ignores it
    for batch, view in [(1, 512), (4, 1024), (16, 640), (16, 2048), (8, 1280), (2, 4096), (16, 2048), (16, 2048)]:
        cost.observe(batch, view, F + G * batch * view + H * batch)
    return cost


def shape(positions: list[int]) -> tuple[int, int]:
    """As Runner.decode_shape (the xla backend's): batch to a power of two, views to eighths past 512 (rounded here to 256)."""
    batch = 1 << (len(positions) - 1).bit_length()
    return batch, max(512, -(-(max(positions) + 1) // 256) * 256)


def test_decode_dispatch_costs_are_fitted_per_shape():
    cost = dispatch_cost()
    assert cost.coef == pytest.approx({"f": F, "g": G, "h": H}, rel=1e-4)
    assert cost.predict(32, 3000) == pytest.approx(F + G * 32 * 3000 + H * 32)
    assert cost.summary()["shapes"] == 6
    few = DispatchCost()
    few.observe(16, 640, 0.1)
    few.observe(16, 700, 0.1)  # two shapes of about one size tell nothing apart
    assert few.predict(1, 1) is None


def test_a_decode_batch_splits_its_short_sequences_from_a_few_long_ones_only_when_that_is_cheaper():
    cost = dispatch_cost()
    short_and_long = [100 + i for i in range(15)] + [3000]
    cut = decode_cut(short_and_long, shape, cost)
    assert cut == 15  # 15 at view 512 and one at 3072: 2F + G*(16*512 + 3072) < F + G*16*3072
    assert cost.predict(*shape(short_and_long[:cut])) + cost.predict(*shape(short_and_long[cut:])) < \
        0.9 * cost.predict(*shape(short_and_long))
    assert decode_cut([300 + 40 * i for i in range(16)], shape, cost) == 0  # similar lengths: one dispatch
    assert decode_cut([100, 3000], shape, cost) == 0  # two sequences: F dominates, one dispatch
    assert decode_cut([100] * 8 + [3000] * 8, shape, cost) == 8
    assert decode_cut(short_and_long, shape, DispatchCost()) == 0  # nothing measured yet: one dispatch

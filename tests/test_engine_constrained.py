"""Constrained decoding, penalties, bias and logprobs in the serving engine (tiny model, random weights, its
real model thread), and the sampler's shaping checked against its definition."""
import asyncio
import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from model.grammar import default_tokenizer_json, grammar_source, token_grammar
from model import reference
from model.sampling import SamplingParams, SamplingRow, argmax_tokens, sample_batch
from model.serving import serving_model
from services.engine.config import EngineConfig
from tests.test_engine_batching import Running, engine_config, prompt, tiny  # noqa: F401 - tiny is a fixture

VOCAB = 129_280
EOS = 1
TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP = 128806, 128807, 128808, 128809, 128814
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "unit", "ok", "where"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"},
                         "where": {"type": "object", "required": ["lat"], "additionalProperties": False,
                                   "properties": {"lat": {"type": "number"}}}}}


@pytest.fixture(scope="module")
def grammars():
    return token_grammar(default_tokenizer_json(None), VOCAB, EOS)


def text(grammars, ids) -> str:
    return grammars.tokenizer.decode_str(ids)


async def collect(run, job) -> tuple[list[dict], dict]:
    tokens, done = [], None
    async for event in run.engine.run(job):
        if event["type"] == "token":
            tokens.append(event)
        elif event["type"] == "done":
            done = event
        elif event["type"] == "error":
            raise AssertionError(event)
    return tokens, done


def smallest_instance_tokens(grammars, source: str) -> int:
    state = grammars.state(source)
    state.mask(10_000)
    return state.need


async def test_json_schema_output_validates_for_20_seeds_at_temperature_1(tiny, tmp_path, grammars):
    source = grammar_source({"type": "json_schema", "schema": SCHEMA})
    async with Running(tiny, engine_config(tmp_path, max_batch=4)) as run:  # a small batch: a quick warm-up
        jobs = [run.job(prompt(i, 12), max_tokens=40, temperature=1.0, seed=i, digest=False)._replace(grammar=source)
                for i in range(20)]
        results = await asyncio.gather(*(collect(run, job) for job in jobs))
    for tokens, done in results:
        answer = json.loads(text(grammars, [t["id"] for t in tokens]))
        jsonschema.validate(answer, SCHEMA)
        assert done["finish_reason"] == "stop" and done["grammar_complete"] is True, done
        assert EOS not in [t["id"] for t in tokens]


async def test_json_object_and_a_lark_grammar_with_tool_call_tokens(tiny, tmp_path, grammars):
    arguments = {"type": "object", "required": ["city"], "additionalProperties": False,
                 "properties": {"city": {"type": "string", "maxLength": 12}}}
    lark = (f'start: <[{TOOL_CALLS_BEGIN}]> call+ <[{TOOL_CALLS_END}]>\n'
            f'call: <[{TOOL_CALL_BEGIN}]> "function" <[{TOOL_SEP}]> "get_weather\\n```json\\n" args "\\n```" '
            f'<[{TOOL_CALL_END}]>\n'
            f'args: %json {json.dumps(arguments)}\n')
    async with Running(tiny, engine_config(tmp_path, max_batch=4)) as run:
        for seed in range(3):
            tokens, done = await collect(run, run.job(prompt(seed, 9), max_tokens=40, temperature=1.0, seed=seed,
                                                      digest=False)._replace(grammar=grammar_source({"type": "json_object"})))
            assert isinstance(json.loads(text(grammars, [t["id"] for t in tokens])), dict)
            assert done["grammar_complete"] is True
            tokens, done = await collect(run, run.job(prompt(seed, 9), max_tokens=80, temperature=1.0, seed=seed,
                                                      digest=False)._replace(grammar=grammar_source(
                                                          {"type": "lark", "grammar": lark})))
            ids = [t["id"] for t in tokens]
            assert ids[:2] == [TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN] and ids[-1] == TOOL_CALLS_END, ids
            assert done["finish_reason"] == "stop" and done["grammar_complete"] is True, done
            first_call = ids[:ids.index(TOOL_CALL_END)]
            body = text(grammars, first_call[first_call.index(TOOL_SEP) + 1:])
            assert body.startswith("get_weather\n```json\n") and body.endswith("\n```"), body
            jsonschema.validate(json.loads(body.split("```json\n")[1][:-4]), arguments)


async def test_a_short_budget_closes_the_json_and_only_a_budget_below_the_smallest_instance_fails(
        tiny, tmp_path, grammars):
    source = grammar_source({"type": "json_schema", "schema": SCHEMA})
    smallest = smallest_instance_tokens(grammars, source)
    assert 10 < smallest < 40
    async with Running(tiny, engine_config(tmp_path, max_batch=4)) as run:
        for budget in (smallest, smallest + 1, smallest + 7):
            jobs = [run.job(prompt(seed, 7), max_tokens=budget, temperature=1.0, seed=seed,
                            digest=False)._replace(grammar=source) for seed in range(4)]
            for tokens, done in await asyncio.gather(*(collect(run, job) for job in jobs)):
                jsonschema.validate(json.loads(text(grammars, [t["id"] for t in tokens])), SCHEMA)
                assert done["grammar_complete"] is True and len(tokens) <= budget, done
        tokens, done = await collect(run, run.job(prompt(9, 7), max_tokens=smallest - 1, temperature=1.0, seed=3,
                                                  digest=False)._replace(grammar=source))
        assert done["finish_reason"] == "length" and done["grammar_complete"] is False
        assert len(tokens) == smallest - 1


async def test_a_preempted_grammar_sequence_keeps_its_grammar_state(tiny, tmp_path, grammars):
    source = grammar_source({"type": "json_schema", "schema": SCHEMA})
    prompts = [prompt(200 + i, 100) for i in range(4)]

    def job(run, i):
        return run.job(prompts[i], max_tokens=40, temperature=1.0, seed=i, digest=False,
                       frequency_penalty=0.5)._replace(grammar=source)

    # 11 pages: one sequence of 100 + 40 tokens needs 3, four together need 12, so the youngest is preempted
    # and resumed (its blocks a memory hit, its grammar state and counts kept with its tokens).
    async with Running(tiny, engine_config(tmp_path, pool_tokens=64 * 10, max_batch=4)) as run:
        alone = [[t["id"] for t in (await collect(run, job(run, i)))[0]] for i in range(4)]
        assert run.metrics.preemptions._value.get() == 0
        together = await asyncio.gather(*(collect(run, job(run, i)) for i in range(4)))
        await run.idle()
        run.check_pages()
        assert run.metrics.preemptions._value.get() >= 1
    assert [[t["id"] for t in tokens] for tokens, _ in together] == alone
    for ids in alone:
        jsonschema.validate(json.loads(text(grammars, ids)), SCHEMA)


async def test_logit_bias_penalties_and_logprobs_through_the_engine(tiny, tmp_path):
    p = prompt(5, 30)
    served = serving_model(tiny.model, EngineConfig().dtype)  # the engine's default serving dtype
    logits_V = reference.prompt_logits(served, p)[-1]
    logp_V = np.asarray(jax.nn.log_softmax(jnp.asarray(logits_V)))
    async with Running(tiny, engine_config(tmp_path, max_batch=1)) as run:
        tokens, _ = await collect(run, run.job(p, max_tokens=6, logit_bias=((777, 100.0),)))
        assert [t["id"] for t in tokens] == [777] * 6
        tokens, _ = await collect(run, run.job(p, max_tokens=1, logprobs=20))
        first = tokens[0]
        # The model's own log-softmax (the reference forward's, to fp tolerance), before any shaping: the chosen
        # (greedy) token leads the top 20, in descending order.
        assert first["id"] == first["top_logprobs"][0][0]
        assert first["logprob"] == pytest.approx(float(logp_V[first["id"]]), abs=1e-3)
        assert [lp for _, lp in first["top_logprobs"]] == pytest.approx(np.sort(logp_V)[::-1][:20].tolist(), abs=1e-3)
        assert all(lp == pytest.approx(float(logp_V[t]), abs=1e-3) for t, lp in first["top_logprobs"])
        # Bias makes token 777 win, yet its logprob is the model's own.
        tokens, _ = await collect(run, run.job(p, max_tokens=1, logprobs=2, logit_bias=((777, 100.0),)))
        assert tokens[0]["id"] == 777 and tokens[0]["logprob"] == pytest.approx(float(logp_V[777]), abs=1e-3)
        assert len(tokens[0]["top_logprobs"]) == 2
        # Penalties against a bias that makes one token repeat, checked token by token against their
        # definition over the reported top 20 (bias and penalties shift the model's logprobs).
        params = {"frequency_penalty": 2.0, "presence_penalty": 0.5, "logit_bias": ((777, 5.0),)}
        tokens, _ = await collect(run, run.job(p, max_tokens=24, logprobs=20, **params))
        counts: dict[int, int] = {}

        def shaped(token, logprob):
            n = counts.get(token, 0)
            return logprob + 5.0 * (token == 777) - 2.0 * n - 0.5 * (n > 0)

        for event in tokens:
            assert shaped(event["id"], event["logprob"]) >= max(shaped(t, lp) for t, lp in event["top_logprobs"]) - 1e-4
            counts[event["id"]] = counts.get(event["id"], 0) + 1
        # +5 wins at first; each repeat costs 2 (+0.5 once): 777 loses its lead after two or three uses.
        assert tokens[0]["id"] == 777 and 2 <= counts[777] <= 3, counts


def test_the_sampler_applies_penalties_and_bias_as_defined_and_reports_raw_logprobs():
    V = 1000
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    a, b = 10, 20
    logits[:, a], logits[:, b] = 9.0, 8.5  # a leads b by 0.5

    def greedy(generated=(), **params):
        row = SamplingRow(SamplingParams(**params), 0, len(generated), generated)
        return int(sample_batch(jnp.asarray(logits), [row, row]).tokens[0])

    assert greedy() == a
    assert greedy((a,), frequency_penalty=0.3) == a  # 0.3 < 0.5
    assert greedy((a, a), frequency_penalty=0.3) == b  # 0.6 > 0.5
    assert greedy((a,) * 5, presence_penalty=0.4) == a  # presence does not grow with the count
    assert greedy((a,) * 5, presence_penalty=0.6) == b
    assert greedy((b,), frequency_penalty=-1.0) == b  # a negative penalty favours repeats
    assert greedy(logit_bias=((b, 0.6),)) == b and greedy(logit_bias=((b, 0.4),)) == a
    assert greedy(logit_bias=((a, -100.0),)) == b
    sampled = sample_batch(jnp.asarray(logits), [SamplingRow(SamplingParams(temperature=1.0, logprobs=20,
                                                                            frequency_penalty=2.0), 3, 1, (a,))] * 2)
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[0])))
    chosen = sampled.logprobs[0]
    assert chosen.logprob == pytest.approx(float(logp[sampled.tokens[0]]), abs=1e-5)
    assert [t for t, _ in chosen.top] == np.argsort(-logp)[:20].tolist()
    assert np.exp(logp).sum() == pytest.approx(1.0, abs=1e-5)
    assert sum(np.exp(lp) for _, lp in chosen.top) <= 1.0
    # Rows asking for fewer (the top-k is computed for the most any row asks, a power of two) or none of the top
    logp_B = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    for asked in ([0, 3], [0, 0], [None, 2]):
        got = sample_batch(jnp.asarray(logits), [SamplingRow(SamplingParams(logprobs=k), 0, 0, ()) for k in asked])
        for i, k in enumerate(asked):
            if k is None:
                assert got.logprobs[i] is None
                continue
            assert got.logprobs[i].logprob == pytest.approx(float(logp_B[i, got.tokens[i]]), abs=1e-5)
            assert [t for t, _ in got.logprobs[i].top] == np.argsort(-logp_B[i])[:k].tolist()
            assert [lp for _, lp in got.logprobs[i].top] == pytest.approx(np.sort(logp_B[i])[::-1][:k], abs=1e-5)


@pytest.mark.parametrize("V", [VOCAB, 1000, 129_281], ids=["vocab", "short", "padded"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_tokens_are_argmaxs_first_index_of_the_maximum(V, dtype):
    """argmax_tokens (two plain reductions over chunks) picks what jnp.argmax picks: ties go to the lowest id,
    across chunks and within one, with -inf rows (a grammar mask) and a vocabulary that is not whole chunks."""
    rng = np.random.default_rng(V)
    logits = rng.normal(size=(9, V)).astype(np.float32)
    logits[1, [7, 300, V - 1]] = 50.0  # a tie across chunks
    logits[2, [129, 130]] = 50.0  # a tie inside one chunk
    logits[3, :] = -np.inf
    logits[3, V - 1] = 0.0  # only the last id allowed (in the padded chunk where V is not whole chunks)
    logits[4, :] = -np.inf  # nothing allowed: argmax says 0
    logits[5, :] = 3.0  # all equal
    logits[6, V - 1] = 50.0
    x = jnp.asarray(logits, dtype)
    assert np.asarray(argmax_tokens(x)).tolist() == np.asarray(jnp.argmax(x, axis=-1)).tolist()
    assert np.asarray(argmax_tokens(x))[[1, 2, 3, 4, 5, 6]].tolist() == [7, 129, V - 1, 0, 0, V - 1]


def _adversarial_walk(grammars, source: str, budget: int, pick) -> tuple[list[int], bool, bool]:
    """Runs a grammar as the engine does, with `pick(allowed ids)` as the sampler; returns (tokens, complete,
    ended) where ended = stopped or the end was taken."""
    state, out = grammars.state(source), []
    while len(out) < budget and not state.stopped:
        allowed = np.flatnonzero(np.unpackbits(state.mask(budget - len(out)).view(np.uint8), bitorder="little"))
        token = state.take(int(pick(allowed)), budget - len(out))
        if token == EOS:
            return out, state.complete, True
        out.append(token)
    return out, state.complete, state.stopped


@pytest.mark.parametrize("pick", [lambda a: a[-1], lambda a: a[len(a) // 2], lambda a: a[a != EOS][0]],
                         ids=["highest-id", "middle-id", "lowest-id"])
def test_an_adversarial_sampler_still_closes_within_every_budget_from_the_smallest_instance(grammars, pick):
    source = grammar_source({"type": "json_schema", "schema": SCHEMA})
    smallest = smallest_instance_tokens(grammars, source)
    for budget in range(smallest, smallest + 12):
        ids, complete, _ = _adversarial_walk(grammars, source, budget, pick)
        assert complete and len(ids) <= budget, (budget, text(grammars, ids))
        jsonschema.validate(json.loads(text(grammars, ids)), SCHEMA)
    ids, complete, _ = _adversarial_walk(grammars, source, smallest - 1, pick)
    assert not complete and len(ids) == smallest - 1


def test_a_complete_answer_ends_rather_than_spend_its_last_token_leaving_the_grammar(grammars):
    # After "x" the answer is complete; "y" would need a "z" the budget of 2 has no room for.
    source = grammar_source({"type": "lark", "grammar": 'start: "x" | "x" "y" "z"'})
    y = grammars.tokenizer.tokenize_str("y")[0]
    ids, complete, ended = _adversarial_walk(grammars, source, 2, lambda a: y if y in a else a[a != EOS][0])
    assert text(grammars, ids) == "x" and complete and ended


def test_a_tokenizer_larger_than_the_models_vocabulary_refuses_grammars_by_name():
    from model.grammar import GrammarError
    with pytest.raises(GrammarError, match="does not fit its vocabulary of 102400 ids"):
        token_grammar(default_tokenizer_json(None), 102_400, EOS)

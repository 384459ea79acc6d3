"""The Engine's public API on a tiny model with a tiny tokenizer: errors, streaming, stops,
logprobs, stats and the CLI."""
import json

import pytest
import torch

import stemma
from stemma import SamplingParams
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("llama_api"))))


@pytest.fixture(scope="module")
def engine(folder):
    return stemma.Engine(folder, dtype="float32", kv_pool_tokens=1024, max_running_requests=8)


@pytest.mark.parametrize("bad, field", [
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"), ({"bogus": 1}, "bogus")])
def test_invalid_params_name_the_field(engine, bad, field):
    with pytest.raises(ValueError, match=field):
        engine.generate("ka lo", bad)
    assert engine.generate("ka lo", GREEDY).finish_reason == "length"  # still serving


def test_bad_prompts(engine):
    with pytest.raises(ValueError, match="outside"):
        engine.generate([5, 500], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.generate([5] * 5000, GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], GREEDY)
    assert engine.generate([], GREEDY) == []


def test_unknown_engine_option(folder):
    with pytest.raises(ValueError, match="unknown engine options: speed"):
        stemma.Engine(folder, speed=3)
    with pytest.raises(ValueError, match="schedule_policy"):
        stemma.Engine(folder, schedule_policy="random")


def test_stream_concatenates_to_generate_text(engine):
    full = engine.generate("ka lo mi", GREEDY)
    deltas = list(engine.stream("ka lo mi", GREEDY))
    assert len(deltas) > 1
    assert "".join(deltas) == full.text


def test_stop_string_across_tokens_is_trimmed(engine):
    full = engine.generate("ka lo mi", GREEDY)
    words = full.text.split()
    stop = f"{words[3]} {words[4]}"  # spans two tokens
    out = engine.generate("ka lo mi", GREEDY.replace(stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    streamed = "".join(engine.stream("ka lo mi", GREEDY.replace(stop=[stop])))
    assert streamed == out.text
    engine.check_pool_whole()


def test_stop_token_ids(engine):
    """The stop token ends the ids; its text is left out (as vLLM and SGLang leave it)."""
    full = engine.generate("ka lo mi", GREEDY)
    stop = full.token_ids[2]
    assert stop not in full.token_ids[:2]
    params = GREEDY.replace(stop_token_ids=[stop])
    out = engine.generate("ka lo mi", params)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:3]
    shown = engine.generate("ka lo mi", GREEDY.replace(max_new_tokens=2)).text
    assert out.text == shown != engine.generate("ka lo mi", GREEDY.replace(max_new_tokens=3)).text
    assert "".join(engine.stream("ka lo mi", params)) == shown
    kept = params.replace(include_stop_str_in_output=True)  # vLLM's: what ended it stays
    three = engine.generate("ka lo mi", GREEDY.replace(max_new_tokens=3)).text
    assert engine.generate("ka lo mi", kept).text == three == "".join(engine.stream("ka lo mi", kept))
    # with stop strings the output's text is their stream's: the ending token went in too
    kept = kept.replace(stop=["never written"])
    assert engine.generate("ka lo mi", kept).text == three == "".join(engine.stream("ka lo mi", kept))
    dropped = params.replace(stop=["never written"])
    assert engine.generate("ka lo mi", dropped).text == shown == "".join(engine.stream("ka lo mi", dropped))


def test_min_new_tokens_holds_stop_strings(engine):
    """As vLLM: a stop string that ends in the first min_new_tokens tokens neither ends nor
    trims the output; the next one that ends later does (the output ended at the first)."""
    full = engine.generate("ka lo mi", GREEDY)
    heads = [engine.generate("ka lo mi", GREEDY.replace(max_new_tokens=m)).text for m in range(1, 8)]
    cases = [(stop, m) for stop in sorted(set(full.text.split()), key=full.text.index)
             for m, head in enumerate(heads, start=1)
             if full.text.index(stop) + len(stop) <= len(head) and full.text.find(stop, len(head) - len(stop) + 1) > 0]
    assert cases  # a word written within the first m tokens and again after them
    stop, m = cases[0]
    head = heads[m - 1]
    later = full.text.find(stop, len(head) - len(stop) + 1)
    held = GREEDY.replace(stop=[stop], min_new_tokens=m)
    out = engine.generate("ka lo mi", held)
    assert out.finish_reason == "stop" and out.text == full.text[:later], (stop, m)
    assert "".join(engine.stream("ka lo mi", held)) == out.text
    assert engine.generate("ka lo mi", GREEDY.replace(stop=[stop])).text == full.text[:full.text.index(stop)]
    never = GREEDY.replace(stop=[full.text.split()[0]], min_new_tokens=GREEDY.max_new_tokens)
    assert engine.generate("ka lo mi", never).text == full.text  # held to the end


def test_include_stop_str_in_output_keeps_the_stop_string(engine):
    full = engine.generate("ka lo mi", GREEDY)
    words = full.text.split()
    stop = f"{words[3]} {words[4]}"  # spans two tokens
    params = GREEDY.replace(stop=[stop], include_stop_str_in_output=True)
    out = engine.generate("ka lo mi", params)
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop) + len(stop)]
    assert "".join(engine.stream("ka lo mi", params)) == out.text


def test_the_text_of_eos_is_left_out(folder, tmp_path):
    """A model whose EOS (generation_config.json's) is a plain token: the output ends at it, and
    its text is left out, as a stop token's is, unless include_stop_str_in_output; past EOS
    (ignore_eos) its text stays."""
    import shutil
    reference = stemma.Engine(folder, dtype="float32", kv_pool_tokens=512, max_running_requests=2)
    full = reference.generate("ka lo mi", GREEDY)
    eos = full.token_ids[2]
    assert eos not in full.token_ids[:2]
    two = reference.generate("ka lo mi", GREEDY.replace(max_new_tokens=2)).text
    three = reference.generate("ka lo mi", GREEDY.replace(max_new_tokens=3)).text
    assert two != three
    copy = shutil.copytree(folder, tmp_path / "eos")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    engine = stemma.Engine(str(copy), dtype="float32", kv_pool_tokens=512, max_running_requests=2)
    ending = SamplingParams(temperature=0, max_new_tokens=16)
    out = engine.generate("ka lo mi", ending)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:3]
    for params, text in ((ending, two), (ending.replace(skip_special_tokens=False), two),
                         (ending.replace(include_stop_str_in_output=True), three),
                         (GREEDY, full.text)):
        assert engine.generate("ka lo mi", params).text == text == "".join(engine.stream("ka lo mi", params))


def test_logprobs_match_a_full_forward(engine):
    ids = engine.tokenize("ka lo mi nu pe ri")
    out = engine.generate(ids, GREEDY.replace(max_new_tokens=4, logprobs=True, top_logprobs=3, logprob_start=2))
    seq = ids + out.token_ids
    from tests.driver import Driver
    from stemma.executor.runner import ModelRunner, RunnerConfig
    d = Driver(ModelRunner(engine.loaded, RunnerConfig(kv_pool_tokens=64, attention_backend="torch")))
    ref = torch.log_softmax(d.step([(d.new(), seq)], all_logits=True)[0].float(), -1)
    want_prompt = [ref[p - 1, seq[p]].item() for p in range(2, len(ids))]
    assert out.prompt_logprobs == pytest.approx(want_prompt, abs=1e-4)
    want_out = [ref[len(ids) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(want_out, abs=1e-4)
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == ref[len(ids) - 1].topk(3).indices.tolist()
    assert top[0][0] == out.token_ids[0]


def test_prompt_logprobs_with_cached_prefix(engine):
    ids = engine.tokenize("so tu vé zo ka lo mi nu")
    engine.generate(ids, GREEDY)  # caches the whole prompt
    a = engine.generate(ids, GREEDY.replace(max_new_tokens=0, logprob_start=4))
    assert a.finish_reason == "length" and a.token_ids == []
    assert len(a.prompt_logprobs) == len(ids) - 4
    assert a.meta["cached_tokens"] <= 3  # the match stopped before the scored positions


def test_prompt_logprobs_across_prefill_chunks(folder, engine):
    """Chunks that end before logprob_start return their last row too: it is not scored (each
    such chunk added one misplaced value at the front)."""
    ids = list(range(4, 60))
    ref = engine.generate(ids, GREEDY.replace(max_new_tokens=1, logprob_start=0)).prompt_logprobs
    chunked = stemma.Engine(folder, dtype="float32", kv_pool_tokens=512, max_running_requests=2,
                            chunked_prefill_size=7, enable_radix_cache=False)
    for start in (0, 1, 6, 7, 8, 10, 30, 55):
        got = chunked.generate(ids, GREEDY.replace(max_new_tokens=1, logprob_start=start)).prompt_logprobs
        assert len(got) == len(ids) - start
        if start == 0:
            assert got[0] is None and ref[0] is None  # the first token has no context
        assert got[start == 0:] == pytest.approx(ref[max(start, 1):], abs=1e-4), start
    chunked.check_pool_whole()


def test_stats_and_flush(engine):
    engine.generate(["ka lo mi nu pe ri so tu", "ka lo mi nu pe ri so vé"], GREEDY)
    s = engine.stats()
    for key in ("cache_hit_rate", "tokens_per_s", "queue", "running", "pool_usage"):
        assert key in s
    assert s["running"] == 0 and s["cached_tokens"] > 0
    engine.check_pool_whole()
    assert engine.flush_cache()
    assert engine.stats()["pool_free"] == engine.stats()["pool_total"]


def test_cli_generate(folder, capsys):
    from stemma.cli import main
    assert main(["generate", "ka lo", "--model", folder, "--max-new-tokens", "5", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ka lo") and len(out.split()) > 2
    assert main(["generate", "ka", "--model", folder, "--max-new-tokens", "-3"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err


def test_prompt_logprobs_of_a_one_token_prompt(engine):
    out = engine.generate([7], GREEDY.replace(max_new_tokens=2, logprob_start=0))
    assert out.prompt_logprobs == [None]
    assert len(out.token_ids) == 2

"""Chat on an export (its chat template: export/chat_template.jinja), as agents call it: the
`openai` client's `chat.completions.create` against the adapter's server.

The template puts every turn's text between special tokens, so a conversation's next prompt
extends the previous prompt and its reply token for token wherever the reply's text encodes to
the tokens the model generated: prefix caching then finds the previous turn's state. Where it does
not (replies that are runs of spaces, which a client's copy of the text turns into fewer tokens),
the state kept at the previous prompt's last block boundary still serves, on the server that
answered and, from `--state-dir`, on one that never saw the conversation.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from shared_fixtures import descendants, running

from serve.vllm_adapter import PREFIX_BLOCK_SIZE as BLOCK

REPLY = 24  # tokens a reply has at most
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()


def client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def rendered(tokenizer, messages) -> list[int]:
    """The prompt's token ids as transformers renders the export's chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat(api, model: str, messages, allowed=None) -> dict:
    """One greedy chat turn (`allowed`: the token ids it may use, vLLM's `allowed_token_ids`):
    the reply's text and token ids, the prompt's token ids as vLLM rendered them, and the
    prompt tokens it took from a cache or the store."""
    out = api.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=REPLY,
        temperature=0,
        extra_body={"return_token_ids": True, "allowed_token_ids": allowed},
    )
    choice = out.choices[0].model_dump()
    details = out.usage.prompt_tokens_details
    return {
        "text": choice["message"]["content"],
        "token_ids": choice["token_ids"],
        "prompt_ids": out.model_dump()["prompt_token_ids"],
        "cached": (details.cached_tokens or 0) if details else 0,
    }


def message(rng) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(20, 40))))


def generated(reply_ids, eos: int) -> list[int]:
    """The reply's tokens as the next prompt holds them: its end-of-text token is the
    template's own end of turn."""
    return reply_ids[:-1] if reply_ids and reply_ids[-1] == eos else reply_ids


def test_four_turn_chats_extend_their_prompts_and_reuse_the_last_state(
    store_server, state_dir, tiny_export
):
    """3 conversations x 4 turns through the openai client (before, every chat request of an
    export answered 400: no chat template). Each turn's greedy reply equals /v1/completions on
    the prompt the template renders (transformers' rendering = vLLM's), each prompt extends the
    one before token for token, and turn k+1 takes from the cache at least turn k's prompt and
    reply (but the last block) where the reply's text encodes to its tokens, else at least turn
    k's prompt (but the last block). Two conversations answer in whole words (vLLM's
    `allowed_token_ids`: the tokens " the", " fox", ...), text that encodes to the same tokens,
    so the reply's bound is met there; the third answers in any of the random model's tokens,
    whose text mostly does not."""
    from transformers import AutoTokenizer

    base = f"http://127.0.0.1:{store_server.port}"  # --state-dir: every boundary kept
    folder = tiny_export[2]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    api = client(base)
    rng = np.random.default_rng(3)
    words = [tokenizer.convert_tokens_to_ids("\u0120" + w) for w in WORDS]  # " the", ...
    assert tokenizer.unk_token_id not in words and None not in words
    extended = 0  # turns whose prompt holds the turn before's reply token for token
    for allowed in (words, words, None):
        messages, before = [], None  # before: (prompt ids, reply ids) of the turn before
        for k in range(4):
            messages.append({"role": "user", "content": message(rng)})
            prompt = rendered(tokenizer, messages)
            got = chat(api, "laplace-tiny", messages, allowed)
            assert got["prompt_ids"] == prompt, k
            completion = api.completions.create(
                model="laplace-tiny", prompt=prompt, max_tokens=REPLY, temperature=0,
                extra_body={"return_token_ids": True, "allowed_token_ids": allowed},
            )  # fmt: skip
            assert completion.choices[0].model_dump()["token_ids"] == got["token_ids"], k
            if before is not None:
                old_prompt, old_reply = before
                assert prompt[: len(old_prompt)] == old_prompt, k
                reply = generated(old_reply, tokenizer.eos_token_id)
                if prompt[: len(old_prompt) + len(reply)] == old_prompt + reply:
                    assert got["cached"] >= len(old_prompt) + len(reply) - BLOCK, k
                    extended += 1
                else:
                    assert got["cached"] >= len(old_prompt) - BLOCK, k
            messages.append({"role": "assistant", "content": got["text"]})
            before = (prompt, got["token_ids"])
    assert extended >= 6  # the reply's bound in every turn after the first of the word replies
    settled_files(state_dir)  # its writes done before tests/test_state_store.py counts files


def test_replies_that_tokenize_anew_resume_from_their_prompts_after_a_sigkill(
    spaces_server, spaces_resume_server, spaces_export, spaces_state_dir
):
    """8 conversations at once on a 2-replica server, whose replies are 24 one-space tokens
    that a client's copy of the text makes 3 (`export_spaces`): turn 2 takes from the cache at
    least turn 1's prompt. Then the server's process is killed with SIGKILL after turn 2: every
    process it started is gone within 10 s (before, its engines ran on as orphans). Turn 3, on
    another server that never saw the conversations, resumes every one from its files: at least
    its turn-2 prompt (before, the store kept one state a request, its newest, which no next
    prompt shares here, and 3 of 8 did not resume even their previous prompt)."""
    from transformers import AutoTokenizer

    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM

    _, _, folder, space = spaces_export
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = LaplaceForCausalLM.from_exported(folder)
    conversations = [
        [{"role": "user", "content": message(np.random.default_rng(c))}] for c in range(8)
    ]
    prompts = [[] for _ in conversations]  # each conversation's prompt ids, turn by turn

    def turn(base, c):
        got = chat(client(base), "spaces", conversations[c])
        assert got["token_ids"] == greedy_generate(model, [got["prompt_ids"]], REPLY)[0]
        assert got["token_ids"] == [space] * REPLY
        assert tokenizer.encode(got["text"], add_special_tokens=False) != got["token_ids"]
        prompts[c].append(got["prompt_ids"])
        conversations[c] += [
            {"role": "assistant", "content": got["text"]},
            {"role": "user", "content": message(np.random.default_rng(100 + c))},
        ]
        return got["cached"]

    base_a, job = spaces_server
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda c: turn(base_a, c), range(8)))
        # turn 2 may go to the other replica: it finds turn 1 in the files, once they are written
        settled_files(spaces_state_dir)
        cached = list(pool.map(lambda c: turn(base_a, c), range(8)))
    for c in range(8):
        assert cached[c] >= len(prompts[c][0]) - BLOCK, c
    # every finished turn's states written (its prompt's, its reply's), then SIGKILL
    settled_files(spaces_state_dir)
    processes = descendants(job.proc.pid)
    assert len(processes) >= 2  # its two engines, at least
    os.kill(job.proc.pid, signal.SIGKILL)
    assert job.proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while running(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(processes), "processes of the killed server still running after 10 s"

    base_b, _ = spaces_resume_server
    with ThreadPoolExecutor(8) as pool:
        cached = list(pool.map(lambda c: turn(base_b, c), range(8)))
    for c in range(8):
        assert len(prompts[c][1]) - BLOCK <= cached[c] <= len(prompts[c][1]), c


def settled_files(root, quiet: float = 2.0, timeout: float = 30) -> int:
    """Until the store under `root` has gained no state file for `quiet` seconds (its writer
    writes right after a request finishes): the count."""
    from serve.state_store import files

    deadline = time.monotonic() + timeout
    count, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(list(root.rglob(f"*{files.SUFFIX}")))
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return count
        time.sleep(0.1)
    pytest.fail(f"the store under {root} still changing after {timeout} s")

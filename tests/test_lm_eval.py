"""lm-eval on an exported folder: the stock `hf` backend through the export's remote code, and
vLLM through `python -m serve.lm_eval --model laplace-vllm`, on a local multiple-choice task.

The truth is the in-package PyTorch model (serve/modeling_laplace.py): each continuation's
log-probability, summed over its tokens, from one forward pass on context + continuation. Both
lm-eval routes must report it per document (`--log_samples`) within `ATOL`, and agree with each
other. Both run offline: the task reads a jsonl file written here, and HF_HUB_OFFLINE /
HF_DATASETS_OFFLINE make any download an error. The `hf` route is the stock `lm_eval` command in
a fresh process (the README's); the vLLM route is `serve.lm_eval.main` in this process on the
session's engine (the engine lm-eval asks for is checked to be that one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TASK = "laplace_tiny_mc"
ATOL = 1e-4  # nats per continuation (fp32: the routes differ by ~1e-6)
DOCS = [  # words of the tiny tokenizer's training text (laplace_export_helpers.corpus)
    {"context": "the quick brown fox", "choices": ["jumps", "sings", "dog"], "label": 0},
    {"context": "seven small birds", "choices": ["sing", "over", "quick"], "label": 0},
    {"context": "a lazy", "choices": ["dog", "fox", "the"], "label": 0},
    {
        "context": "the dog jumps over",
        "choices": ["the lazy fox", "seven", "birds sing"],
        "label": 0,
    },
    {"context": "while", "choices": ["seven small birds sing", "a", "brown dog"], "label": 1},
    {"context": "birds sing over the", "choices": ["quick", "lazy dog", "fox while"], "label": 2},
]
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lm_eval")


@pytest.fixture(scope="module")
def exported(tiny_export):
    return tiny_export[2]


OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def env(root):
    env = dict(os.environ)
    env.update(HF_HOME=str(root / "hf"), **OFFLINE)  # remote-code module and datasets caches
    return env


@pytest.fixture(scope="module")
def task_dir(root):
    d = root / "tasks"
    d.mkdir()
    (d / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (d / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=d / "docs.jsonl"))
    return d


def torch_truth(model_dir: Path) -> list[list[tuple[float, bool]]]:
    """Per document and choice: (sum of log p(continuation tokens | prefix), all greedy), from
    the in-package model; lm-eval's split: tokens of context + " " + choice after those of the
    context."""
    import torch
    from tokenizers import Tokenizer

    from serve.modeling_laplace import LaplaceForCausalLM

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = LaplaceForCausalLM.from_exported(model_dir)
    out = []
    for doc in DOCS:
        ctx = tok.encode(doc["context"]).ids
        row = []
        for choice in doc["choices"]:
            whole = tok.encode(doc["context"] + " " + choice).ids
            assert whole[: len(ctx)] == ctx
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
            pos = range(len(ctx), len(whole))
            ll = sum(float(logp[i - 1, whole[i]]) for i in pos)
            greedy = all(int(logp[i - 1].argmax()) == whole[i] for i in pos)
            row.append((ll, greedy))
        out.append(row)
    return out


def task_args(out: Path) -> list[str]:
    return ["--tasks", TASK, "--output_path", str(out), "--log_samples"]


def run_lm_eval(cmd: list[str], out: Path, env: dict, cwd: Path) -> list[list[tuple[float, bool]]]:
    """Run an lm-eval command with the task; per document and choice (loglikelihood, greedy)."""
    proc = subprocess.run(
        cmd + task_args(out), env=env, cwd=cwd, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return logged_samples(out)


def logged_samples(out: Path) -> list[list[tuple[float, bool]]]:
    """The run's `--log_samples` file, checked: per document and choice (loglikelihood, greedy)."""
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    (results,) = out.rglob("results_*.json")
    assert "acc,none" in json.loads(results.read_text())["results"][TASK]
    rows = sorted(
        (json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"]
    )
    assert [r["doc"] for r in rows] == DOCS
    for r, doc in zip(rows, DOCS, strict=True):  # the requests are the ones the truth scores
        args_ = [(a["arg_0"], a["arg_1"]) for a in r["arguments"].values()]
        assert args_ == [(doc["context"], " " + c) for c in doc["choices"]]
    return [[(float(ll), greedy == "True") for ((ll, greedy),) in r["resps"]] for r in rows]


@pytest.fixture(scope="module")
def truth(exported):
    return torch_truth(exported)


@pytest.fixture(scope="module")
def hf_results(exported, task_dir, env, root):
    """The stock `hf` backend; the folder's remote code, not this package, defines the model."""
    model_args = f"pretrained={exported},trust_remote_code=True"
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        model_args,
        "--device",
        "cpu",
        "--include_path",
        str(task_dir),
    ]
    return run_lm_eval(cmd, root / "out_hf", env, cwd=root)


@pytest.fixture(scope="module")
def vllm_results(exported, task_dir, root, vllm_engine):
    """`python -m serve.lm_eval run --model laplace-vllm ...` as `serve.lm_eval.main` in this
    process. lm-eval's backend builds its engine with `vllm.LLM(**kwargs)`: those kwargs must
    set up the session engine's configuration (what `make_llm(folder, max_num_seqs=8)` set) and
    be a valid vLLM engine configuration as a whole (EngineArgs, no engine built); the session
    engine then answers in place of a second one of the same configuration."""
    import datasets
    import huggingface_hub
    from vllm.engine.arg_utils import EngineArgs

    from serve import lm_eval as laplace_lm_eval  # first: it imports lm-eval's vLLM backend
    from serve.vllm_adapter import engine_kwargs, serving_platform

    backend = sys.modules["lm_eval.models.vllm_causallms"]

    asked = {}

    def the_session_engine(**kwargs):
        asked.update(kwargs)
        return vllm_engine

    model_args = f"pretrained={exported},max_num_seqs=8"
    argv = ["run", "--model", "laplace-vllm", "--model_args", model_args]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "LLM", the_session_engine)
        mp.setattr(sys, "argv", list(sys.argv))  # main() sets sys.argv for lm-eval's parser
        mp.setenv("TOKENIZERS_PARALLELISM", "false")  # lm-eval sets it; given back after
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        for module in (datasets.config, huggingface_hub.constants):  # read at their import
            mp.setattr(module, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets")
        laplace_lm_eval.main([*argv, "--include_path", str(task_dir), *task_args(root / "out")])
    built = engine_kwargs(str(exported), max_num_seqs=8, platform=serving_platform())
    defining = ("model", "dtype", "enforce_eager", "enable_prefix_caching", "max_num_seqs")
    assert {k: asked.get(k) for k in defining} == {k: built[k] for k in defining}
    assert asked.get("tensor_parallel_size", 1) == 1 and asked.get("max_model_len") is None
    config = EngineArgs(**asked).create_engine_config()
    assert config.model_config.max_model_len == vllm_engine.llm_engine.model_config.max_model_len
    return logged_samples(root / "out")


def assert_matches(results, truth):
    for got, want in zip(results, truth, strict=True):
        assert [g for _, g in got] == [g for _, g in want]
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=ATOL)


def test_hf_backend_matches_torch(hf_results, truth):
    assert_matches(hf_results, truth)


def test_vllm_backend_matches_torch(vllm_results, truth):
    assert_matches(vllm_results, truth)


def test_hf_and_vllm_agree(hf_results, vllm_results):
    assert_matches(hf_results, vllm_results)


REMOTE_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids = torch.tensor([[5, 17, 200, 3, 42, 7]])
with torch.no_grad():
    logits = model(ids).logits
gen = model.generate(ids, max_new_tokens=8, do_sample=False)
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("laplace_spec", "serve", "export"))
print(json.dumps({"logits": logits.tolist(), "generated": gen.tolist(), "imported": ours,
                  "class": type(model).__module__}))
"""


def test_remote_code_loads_without_the_package(exported, env, root):
    """A fresh process loads the folder by its auto_map, imports nothing of this repo, and
    computes the in-package model's logits and greedy tokens."""
    import torch

    from serve.modeling_laplace import LaplaceForCausalLM

    conf = json.loads((exported / "config.json").read_text())
    assert conf["auto_map"]["AutoModelForCausalLM"] == "modeling_laplace.LaplaceForCausalLM"
    for f in ("config.py", "names.py", "kernels.py", "configuration_laplace.py"):
        assert "from laplace_spec" not in (exported / f).read_text()
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(exported)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["imported"] == []
    assert got["class"].startswith("transformers_modules.")
    model = LaplaceForCausalLM.from_exported(exported)
    ids = torch.tensor([[5, 17, 200, 3, 42, 7]])
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(torch.tensor(got["logits"]), want, rtol=0, atol=1e-6)
    assert got["generated"] == model.generate(ids, max_new_tokens=8, do_sample=False).tolist()


@pytest.mark.parametrize(
    "line, problem",
    [
        ("from laplace_spec import names", "write package imports as"),  # not followed by HF
        ("from serve.generation import greedy_generate", "not in REMOTE_CODE"),
        ("import serve.kernels", "write package imports as"),
    ],
)
def test_remote_code_refuses_unfollowable_imports(tmp_path, monkeypatch, line, problem):
    """An import the copied folder could not satisfy fails the export, naming the module."""
    from export import exporter

    (tmp_path / "remote_probe.py").write_text(f"import json\n{line}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(exporter.ExportError, match=problem):
        exporter.remote_code_source("remote_probe")
    ok = exporter.remote_code_source("serve.modeling_laplace")
    assert "from .configuration_laplace import LaplaceHFConfig" in ok

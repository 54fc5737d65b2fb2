"""lm-evaluation-harness on plait's model (``plait eval --tasks``), against the harness's
own ``HFLM`` on the same ``transformers`` model.

A tiny ``LlamaForCausalLM`` (random, float64) and a BPE tokenizer with a BOS post-processor
are made here (``save_pretrained``; nothing is downloaded). The bundled tasks of
``tests/fixtures/lm_eval`` — 8 multiple-choice questions, 4 documents for rolling
perplexity (two longer than the model's 64-token context: several windows), 4 greedy
generations — run through the same ``simple_evaluate`` with ``HFLM`` (float64, batch 8)
and with :class:`~plait.train.lm_eval_adapter.PlaitLM` in one process, tp2, dp2, pp2
(no generation: it needs pp = 1) and cp2 (the worker pool; batches of 3 rows, so the
pipeline's 2 micro-batches need a padding row): the accuracies and every greedy
decision are equal exactly, the log-likelihoods to rel 1e-9 and the perplexities to rel
1e-6 (float64: the two models sum in other orders, seen up to ~1e-10 apart), the
generated texts equal. Since a random model's answers
are never its arg-max, the per-token scores are also checked on a sequence that *is*
``transformers``' greedy continuation (every decision true there). ``plait eval --tasks``
runs docs/fine-tuning.md's command in-process; ``--apply-chat-template`` renders the
folder's chat template as ``HFLM`` does; an unknown task exits 2 with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.testing import WorkerContext, WorkerPool

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "lm_eval"
DOC = ROOT / "docs" / "fine-tuning.md"
TASKS = ["tiny_choice", "tiny_rolling", "tiny_gen"]
VOCAB, CONTEXT = 320, 64


def make_model(folder: Path) -> Path:
    """A tiny random Llama (vocabulary 320, context 64) and a 300-token BPE trained on the
    fixtures' text, whose post-processor puts ``<s>`` first (as Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = [
        str(v)
        for f in sorted(FIXTURES.glob("*.jsonl"))
        for line in f.read_text(encoding="utf-8").splitlines()
        for v in json.loads(line).values()
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _specs(tasks: list[str] = TASKS) -> Any:
    from plait.train.lm_eval_tasks import resolve_tasks

    return resolve_tasks(",".join(str(FIXTURES / f"{t}.yaml") for t in tasks))


def _summary(results: dict[str, Any] | None) -> dict[str, Any] | None:
    """Each task's metrics and its responses in document order (None off rank 0): each
    request's first response (a request the harness repeated to even out the dp ranks'
    counts holds its answer twice)."""
    if results is None:
        return None
    samples = {
        task: [[r[0] for r in s["resps"]] for s in sorted(rows, key=lambda s: s["doc_id"])]
        for task, rows in results["samples"].items()
    }
    return {"results": results["results"], "resps": samples}


@contextlib.contextmanager
def datasets_offline() -> Iterator[None]:
    """``HF_DATASETS_OFFLINE=1`` (the tasks' files are local) for the block, restored
    after: a variable the zygote's preloaded modules read must not leak into the session
    (later subprocesses would all start fresh interpreters)."""
    old = os.environ.get("HF_DATASETS_OFFLINE")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = old


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with datasets_offline():
        yield make_model(tmp_path_factory.mktemp("lm_eval") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(folder: Path) -> dict[str, Any]:
    """The harness's ``HFLM`` on the transformers model, float64, batch 8."""
    from lm_eval.models.huggingface import HFLM

    from plait.train.lm_eval_tasks import run_tasks

    hf = HFLM(pretrained=str(folder), dtype="float64", batch_size=8, device="cpu")
    out = _summary(run_tasks(hf, _specs(), bootstrap_iters=0))
    assert out is not None
    return out


@pytest.fixture(scope="module")
def greedy(folder: Path) -> tuple[list[int], torch.Tensor]:
    """A prompt followed by transformers' 10 greedy tokens, and transformers' float64
    log-softmax over it ``(len - 1, vocab)``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    prompt = torch.tensor([[0, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
        logp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
    return [int(i) for i in ids[0]], logp


def _plait_lm(ctx: WorkerContext | None, folder: str, layout: dict[str, int]) -> Any:
    """The folder's model loaded into plait (float64) on ``layout``, as a ``PlaitLM``."""
    from plait.checkpoint import load_hf_weights, pretrained_config
    from plait.config import ParallelConfig
    from plait.mesh import init_mesh
    from plait.model.factory import build_model
    from plait.parallel.parallelize import parallelize
    from plait.train.lm_eval_adapter import PlaitLM, eval_tokenizer

    tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
    world = 1 if ctx is None else ctx.world_size
    mesh = init_mesh() if ctx is None else ctx.mesh(dp=world // (tp * pp * cp), tp=tp, pp=pp, cp=cp)
    model = build_model(pretrained_config(folder), seed=0).double()
    pcfg = ParallelConfig(tp=tp, pp=pp, cp=cp, microbatches=2)
    pm = parallelize(model, mesh, pcfg, zero=layout.get("zero", 0))
    load_hf_weights(pm, folder)
    return PlaitLM(pm, eval_tokenizer(f"hf:{folder}"), VOCAB, CONTEXT, batch_size=3)


def _body(
    ctx: WorkerContext | None, folder: str, layout: dict[str, int], seq: list[int]
) -> dict[str, Any]:
    """Run the tasks on ``layout``; also score ``seq`` directly."""
    with datasets_offline():
        return _tasks_and_scores(ctx, folder, layout, seq)


def _tasks_and_scores(
    ctx: WorkerContext | None, folder: str, layout: dict[str, int], seq: list[int]
) -> dict[str, Any]:
    from plait.train.lm_eval_tasks import run_tasks
    from plait.train.token_scores import score_sequences

    lm = _plait_lm(ctx, folder, layout)
    tasks = [t for t in TASKS if layout.get("pp", 1) == 1 or t != "tiny_gen"]  # needs pp = 1
    summary = _summary(run_tasks(lm, _specs(tasks), bootstrap_iters=0))
    scores = score_sequences(lm.model, [seq], VOCAB)[0]
    return {"summary": summary, "scores": torch.from_numpy(scores)}


def _check(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Accuracies and decisions exact, log-likelihoods rel 1e-9, perplexities rel 1e-6,
    texts equal."""
    acc = [("plait_tiny_choice", m) for m in ("acc,none", "acc_norm,none")]
    for task, metric in acc:
        assert got["results"][task][metric] == want["results"][task][metric]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        value = got["results"]["plait_tiny_rolling"][metric]
        assert value == pytest.approx(want["results"]["plait_tiny_rolling"][metric], rel=1e-6)
    choice_got, choice_want = got["resps"]["plait_tiny_choice"], want["resps"]["plait_tiny_choice"]
    assert len(choice_got) == len(choice_want) == 8
    for doc_got, doc_want in zip(choice_got, choice_want, strict=True):
        for (lp, greedy), (lp_want, greedy_want) in zip(doc_got, doc_want, strict=True):
            assert greedy == greedy_want
            assert lp == pytest.approx(lp_want, rel=1e-9)
    rolling = zip(
        got["resps"]["plait_tiny_rolling"], want["resps"]["plait_tiny_rolling"], strict=True
    )
    for [lp], [lp_want] in rolling:
        assert lp == pytest.approx(lp_want, rel=1e-9)
    if "plait_tiny_gen" in got["resps"]:  # not under pp
        assert got["resps"]["plait_tiny_gen"] == want["resps"]["plait_tiny_gen"]


def _check_scores(scores: torch.Tensor, seq: list[int], logp: torch.Tensor) -> None:
    """Per-token scores of ``seq`` equal transformers' log-softmax and arg-max."""
    targets = torch.tensor(seq[1:])
    want = logp.gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(scores[:, 0], want, rtol=1e-9, atol=1e-12)
    greedy = (logp.argmax(-1) == targets).double()
    assert torch.equal(scores[:, 1], greedy)
    assert scores[-10:, 1].all()  # the greedy continuation: every decision true


LAYOUTS = [(1, {}), (2, {"tp": 2}), (2, {}), (2, {"zero": 3}), (2, {"pp": 2}), (2, {"cp": 2})]
IDS = ["1proc", "tp2", "dp2", "zero3-dp2", "pp2", "cp2"]


@pytest.mark.parametrize("world,layout", LAYOUTS, ids=IDS)
def test_tasks_equal_the_harness_on_transformers(
    pools: Callable[[int], WorkerPool],
    folder: Path,
    reference: dict[str, Any],
    greedy: tuple[list[int], torch.Tensor],
    world: int,
    layout: dict[str, int],
) -> None:
    seq, logp = greedy
    if world == 1:
        runs = [_body(None, str(folder), layout, seq)]
    else:
        runs = pools(world).run(_body, str(folder), layout, seq)
    summaries = [r["summary"] for r in runs if r["summary"] is not None]
    # the harness's rank 0 is dp index 0 of every replica coordinate: dp2 has one
    assert len(summaries) == (world if layout and "zero" not in layout else 1)
    for s in summaries:
        _check(s, reference)
    for r in runs:
        _check_scores(r["scores"], seq, logp)


def _doc_command() -> list[str]:
    """The ``plait eval --tasks`` line of docs/fine-tuning.md's "Evaluating on tasks"."""
    section = DOC.read_text(encoding="utf-8").split("## Evaluating on tasks", 1)[1]
    block = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0]
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [line[:2] for line in lines] == [["plait", "eval"]]
    return lines[0][1:]


def test_doc_yaml_is_the_bundled_task() -> None:
    """The page's task file is the bundled multiple-choice task, verbatim."""
    section = DOC.read_text(encoding="utf-8").split("## Evaluating on tasks", 1)[1]
    shown = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)[0]
    assert shown == (FIXTURES / "tiny_choice.yaml").read_text(encoding="utf-8")


def test_cli_runs_the_doc_command(
    folder: Path,
    reference: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/fine-tuning.md's command, in its folder (the model and the tasks copied there):
    it prints the harness's table and writes its JSON, whose accuracy is the reference's
    (float32 here: the decisions are far from ties)."""
    from plait.cli import main

    shutil.copytree(folder, tmp_path / "tiny-llama")
    shutil.copytree(FIXTURES, tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)
    assert main(_doc_command()) == 0
    out = capsys.readouterr().out
    assert "|plait_tiny_choice |" in out and "acc_norm" in out
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    want = reference["results"]["plait_tiny_choice"]
    assert results["plait_tiny_choice"]["acc,none"] == want["acc,none"]
    ppl = results["plait_tiny_rolling"]["word_perplexity,none"]
    assert ppl == pytest.approx(
        reference["results"]["plait_tiny_rolling"]["word_perplexity,none"], rel=1e-4
    )


@pytest.mark.parametrize(
    "tasks,include,message",
    [
        ("no_such_task", str(FIXTURES), "unknown task 'no_such_task'"),
        ("missing.yaml", None, "--tasks missing.yaml: no such task file"),
        ("plait_tiny_choice", str(FIXTURES), "--apply-chat-template: the tokenizer hf:"),
    ],
)
def test_unknown_task_exits_2_with_one_line(
    folder: Path,
    capsys: pytest.CaptureFixture[str],
    tasks: str,
    include: str | None,
    message: str,
) -> None:
    from plait.cli import main

    more = ["--include-path", include] if include else []
    if "chat" in message:  # the test tokenizer has no chat template
        more.append("--apply-chat-template")
    assert main(["eval", "--init-from", str(folder), "--tasks", tasks, *more]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_template_prompts_equal_the_harness(folder: Path, tmp_path: Path) -> None:
    """``--apply-chat-template``: the prompts rendered by the folder's chat template and
    the answers equal ``HFLM``'s (one process, the multiple-choice task)."""
    from lm_eval.models.huggingface import HFLM

    from plait.train.lm_eval_tasks import run_tasks

    chat = tmp_path / "chat"
    shutil.copytree(folder, chat)
    tok = transformers.AutoTokenizer.from_pretrained(chat)
    tok.chat_template = CHAT
    tok.save_pretrained(chat)
    specs = _specs(["tiny_choice"])
    hf = HFLM(pretrained=str(chat), dtype="float64", batch_size=8, device="cpu")
    want = _summary(run_tasks(hf, specs, apply_chat_template=True, bootstrap_iters=0))
    lm = _plait_lm(None, str(chat), {})
    results = run_tasks(lm, specs, apply_chat_template=True, bootstrap_iters=0)
    assert results is not None and want is not None
    first = results["samples"]["plait_tiny_choice"][0]["arguments"][0][0]
    assert first.startswith("<s>user: Question:") and first.endswith("assistant:")
    got = _summary(results)
    assert got is not None
    for metric in ("acc,none", "acc_norm,none"):
        assert (
            got["results"]["plait_tiny_choice"][metric]
            == want["results"]["plait_tiny_choice"][metric]
        )
    docs = zip(got["resps"]["plait_tiny_choice"], want["resps"]["plait_tiny_choice"], strict=True)
    for doc_got, doc_want in docs:
        for (lp, greedy), (lp_want, greedy_want) in zip(doc_got, doc_want, strict=True):
            assert greedy == greedy_want and lp == pytest.approx(lp_want, rel=1e-9)

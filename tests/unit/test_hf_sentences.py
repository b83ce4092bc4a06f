"""The sentence tasks on their own (no server): their requests as Hugging Face's inference toolkit takes them, and
answers equal to sentence-transformers' own (``SentenceTransformer.encode``, ``util.cos_sim``, ``CrossEncoder.predict``
and ``rank``) to 1e-4, the rows of several requests sharing passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hf_models
import hf_sentence_models
import pytest
import torch

from mme_runtime.base.errors import InvalidInput, ModelLoadError
from mme_runtime.huggingface import loading as hf_loading
from mme_runtime.huggingface import sentences as hf_sentences
from mme_runtime.huggingface.requests import TaskRequest, decode
from mme_runtime.huggingface.tasks import TaskRunner, shape

LONG = hf_models.text_of_tokens(80, 5)  # past the model's max_seq_length (24): cut, as sentence-transformers cuts it
TEXTS = ["paris is", "the capital of france", LONG, "good"]
PAIRS = [["paris is", "the capital of france"], ["good", LONG], ["a", "b"], [LONG, LONG]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sentence-models")
    hf_sentence_models.sentence_transformer(root / "hub")
    hf_sentence_models.sentence_transformer(root / "modern", modern=True, normalize=False, seed=1)
    hf_sentence_models.sentence_transformer(root / "cls", pooling="cls", seed=2)
    hf_sentence_models.cross_encoder(root / "ranker")
    hf_sentence_models.cross_encoder(root / "two-labels", num_labels=2, seed=1)
    hf_sentence_models.cross_encoder(root / "tanh", activation="torch.nn.modules.activation.Tanh", seed=2)
    hf_sentence_models.cross_encoder(root / "short", seed=3, max_seq_length=12)
    hf_sentence_models.sentence_transformer(root / "lower", do_lower_case=True, seed=3)
    return root


def runner(directory: Path, task: str) -> TaskRunner:
    model = hf_loading.load(directory, task, trust_remote_code=False)
    return TaskRunner(model.place(torch.device("cpu")), torch.device("cpu"))


def ask(runner: TaskRunner, task: str, *inputs: Any) -> list[Any]:
    """Each request's answer, all of them run in one batch as concurrent requests are."""
    requests = [decode(json.dumps({"inputs": one}), "application/json", task) for one in inputs]
    answers = runner.run(requests)
    shaped, first = [], 0
    for request in requests:
        shaped.append(json.loads(json.dumps(shape(task, answers[first : first + request.rows], request))))
        first += request.rows
    return shaped


def close(ours: Any, theirs: Any) -> bool:
    return bool(torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0))


@pytest.mark.parametrize("name", ["hub", "modern", "cls", "lower"])
def test_embeddings_and_similarities_are_sentence_transformers_own(root: Path, name: str) -> None:
    from sentence_transformers import SentenceTransformer, util

    reference = SentenceTransformer(str(root / name), device="cpu")
    embeddings = runner(root / name, "sentence-embeddings")
    one, several, wrapped = ask(embeddings, "sentence-embeddings", TEXTS[0], TEXTS, {"sentences": TEXTS[1:]})
    assert close(one["embeddings"], reference.encode(TEXTS[0]).tolist())
    assert close(several["embeddings"], reference.encode(TEXTS).tolist())
    assert close(wrapped["embeddings"], reference.encode(TEXTS[1:]).tolist())
    similarity = runner(root / name, "sentence-similarity")
    cases = [{"source_sentence": source, "sentences": TEXTS} for source in (TEXTS[0], LONG)]
    for case, answer in zip(cases, ask(similarity, "sentence-similarity", *cases), strict=True):
        source = reference.encode(case["source_sentence"], convert_to_tensor=True)
        expected = util.cos_sim(source, reference.encode(TEXTS, convert_to_tensor=True)).tolist()[0]
        assert list(answer) == ["similarities"] and close(answer["similarities"], expected)


@pytest.mark.parametrize("name", ["ranker", "two-labels", "tanh", "short"])
def test_scores_are_cross_encoder_predicts_with_its_activation(root: Path, name: str) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(root / name), device="cpu")
    several, one = ask(runner(root / name, "sentence-ranking"), "sentence-ranking", PAIRS, PAIRS[1])
    assert close(several["scores"], reference.predict(PAIRS).tolist())
    assert isinstance(one["scores"], float if name != "two-labels" else list)
    assert close(one["scores"], reference.predict(PAIRS[1]).tolist())


def test_do_lower_case_lowercases_texts_as_sentence_transformers_does(root: Path) -> None:
    lower = runner(root / "lower", "sentence-embeddings")
    shouted, quiet = ask(lower, "sentence-embeddings", "PARIS is THE Capital", "paris is the capital")
    assert close(shouted["embeddings"], quiet["embeddings"])
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(root / "lower"), device="cpu")
    assert close(shouted["embeddings"], reference.encode("PARIS is THE Capital").tolist())
    cased = runner(root / "hub", "sentence-embeddings")  # its tokenizer lowercases: texts are left to it
    assert cased.model.tokenizer.backend_tokenizer.normalizer.__class__.__name__ == "BertNormalizer"


def test_a_ranking_is_cross_encoder_rank_with_the_toolkits_index(root: Path) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(root / "ranker"), device="cpu")
    query, texts = "the capital of france", ["good", "paris is the capital of france", LONG]
    plain, documents = ask(
        runner(root / "ranker", "sentence-ranking"),
        "sentence-ranking",
        {"query": query, "texts": texts},
        {"query": query, "texts": texts, "return_documents": True},
    )
    expected = reference.rank(query, texts, return_documents=True)
    assert [record["index"] for record in documents] == [record["corpus_id"] for record in expected]
    assert [list(record) for record in documents] == [["score", "text", "index"]] * 3  # the toolkit's key order
    assert [record["text"] for record in documents] == [record["text"] for record in expected]
    assert close([r["score"] for r in documents], [r["score"] for r in expected])
    assert [list(record) for record in plain] == [["score", "index"]] * 3
    assert [r["index"] for r in plain] == [r["index"] for r in documents] and close(
        _numbers(plain), _numbers(documents)
    )
    assert hf_loading.resolve_task(root / "ranker", "text-ranking", None) == "sentence-ranking"


def test_the_rows_of_requests_in_one_batch_answer_as_each_alone(root: Path) -> None:
    ranking = runner(root / "ranker", "sentence-ranking")
    inputs = [PAIRS, {"query": "paris", "texts": TEXTS}, PAIRS[0], {"sentences": PAIRS[:2]}]
    together = ask(ranking, "sentence-ranking", *inputs)
    alone = [ask(ranking, "sentence-ranking", one)[0] for one in inputs]
    assert all(close(_numbers(a), _numbers(b)) for a, b in zip(together, alone, strict=True))


def _numbers(answer: Any) -> Any:
    return answer["scores"] if isinstance(answer, dict) else [record["score"] for record in answer]


@pytest.mark.parametrize(
    ("task", "inputs", "fragment"),
    [
        ("sentence-similarity", "paris", "source_sentence"),
        ("sentence-similarity", {"source_sentence": "a", "sentences": []}, "empty"),
        ("sentence-similarity", {"source_sentence": 3, "sentences": ["a"]}, "string"),
        ("sentence-embeddings", [1, 2], "list of strings"),
        ("sentence-embeddings", {"texts": ["a"]}, "sentences"),
        ("sentence-ranking", "paris", "pairs"),
        ("sentence-ranking", ["a", "b", "c"], "pairs"),
        ("sentence-ranking", [["a", "b"], ["c"]], "pairs"),
        ("sentence-ranking", {"query": "a"}, "texts"),
        ("sentence-ranking", {"query": "a", "texts": ["b"], "top": 2}, "top"),
        ("sentence-ranking", {"sentences": [["a", "b"]], "query": "a", "texts": ["b"]}, "not both"),
        ("sentence-ranking", {"query": "a", "texts": ["b"], "return_documents": "yes"}, "return_documents"),
    ],
)
def test_bad_inputs_name_what_the_task_takes(task: str, inputs: Any, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        decode(json.dumps({"inputs": inputs}), "application/json", task)


def test_parameters_are_refused_rather_than_dropped_unread() -> None:
    with pytest.raises(InvalidInput, match="no parameters"):
        decode(
            '{"inputs": "a", "parameters": {"normalize_embeddings": true}}', "application/json", "sentence-embeddings"
        )


def test_a_ranking_needs_one_label(root: Path) -> None:
    two_labels = runner(root / "two-labels", "sentence-ranking")
    request = decode(
        json.dumps({"inputs": {"query": "a", "texts": ["b", "c"]}}), "application/json", "sentence-ranking"
    )
    with pytest.raises(InvalidInput, match="one label"):
        shape("sentence-ranking", two_labels.run([request]), request)


def test_a_directory_with_modules_served_only_with_code_fails_the_load(root: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(root / "hub", tmp_path / "dense")
    modules = json.loads((tmp_path / "dense" / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "dense" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        hf_loading.load(tmp_path / "dense", "sentence-embeddings", trust_remote_code=False)


def test_pooling_is_read_in_every_format_and_a_plain_bert_pools_the_mean(tmp_path: Path) -> None:
    assert hf_sentences.pooling_mode({"pooling_mode": "cls"}) == "cls"
    assert hf_sentences.pooling_mode({"pooling_mode": ["mean"]}) == "mean"
    assert hf_sentences.pooling_mode({"pooling_mode": ["mean", "max"]}) is None
    assert hf_sentences.pooling_mode({"pooling_mode_max_tokens": True}) == "max"
    assert hf_sentences.pooling_mode({"pooling_mode_cls_token": False}) == "mean"
    plain = hf_loading.load(hf_models.bert(tmp_path / "plain", "feature-extraction"), "sentence-embeddings", False)
    assert (plain.task, plain.pooling, plain.normalize, plain.truncate_to) == ("feature-extraction", "mean", False, 512)


def test_the_activation_is_read_where_sentence_transformers_reads_it(root: Path, tmp_path: Path) -> None:
    config = hf_loading.load(root / "ranker", "sentence-ranking", False).model.config
    assert hf_sentences.score_activation(root / "ranker", config) == "Sigmoid"
    (tmp_path / "config_sentence_transformers.json").write_text('{"activation_fn": "torch.nn.modules.linear.Identity"}')
    assert hf_sentences.score_activation(tmp_path, config) == "Identity"
    config.sbert_ce_default_activation_function = "torch.nn.Tanh"
    assert hf_sentences.score_activation(root / "ranker", config) == "Tanh"
    config.sbert_ce_default_activation_function = "my_package.Scale"  # code of its own: the default, as untrusted
    assert hf_sentences.score_activation(root / "ranker", config) == "Sigmoid"
    config.sbert_ce_default_activation_function = "torch.nn.Linear"
    with pytest.raises(ModelLoadError, match="not a plain activation"):
        hf_sentences.score_activation(root / "ranker", config)


def test_a_sentence_request_is_a_task_request_the_batcher_can_join(root: Path) -> None:
    request = decode('{"inputs": {"source_sentence": "a", "sentences": ["b", "c"]}}', None, "sentence-similarity")
    assert isinstance(request, TaskRequest) and request.rows == 3 and request.batch_signature() == ("hugging-face",)

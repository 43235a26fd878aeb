"""Classification, scoring and reranking (jaxserve/scoring.py, server/score_api.py) against
transformers: a Qwen3 cross-encoder (one label) served, its /score (1:1, 1:N, N:N), /rerank and
/classify through plain HTTP against Qwen3ForSequenceClassification on the pairs transformers'
tokenizer lays out; a three-label Llama classifier's LLM.classify (softmax, id2label's order);
an embedding model's LLM.score (cosine of transformers' last hidden states); bad bodies and the
models that refuse a task; a Qwen3-Reranker (a causal LM) under vLLM's hf_overrides."""
import json
import os

import numpy as np
import pytest
import requests
import torch
import transformers as tf
from tokenizers import Tokenizer, processors

from jaxserve import LLM, PoolingParams, checkpoint, pooling, scoring
from jaxserve.config import EngineConfig
from jaxserve.models import build_model
from jaxserve.sampling_params import InvalidRequest
from tests import server_harness
from tests.hf_models import save_byte_tokenizer, save_hf_model

QUERY = "what is a llama?"
DOCUMENTS = ["a llama is a camelid", "paris is in france", "llamas live in the andes", "no"]
ENGINE = dict(max_model_len=128, page_size=16, max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=64,
              max_prefill_seqs=2, compilation_cache_dir=None, step_shapes="largest")


def save_classifier(name: str, path: str, labels: list[str]):
    """A seeded `name` sequence classifier with a byte tokenizer whose pairs are laid out as
    "<s> A </s> B </s>" (so a pair is not its texts' concatenation); its score head wide enough
    that the labels' logits differ by units. Returns the transformers model."""
    model = save_hf_model(name, path, auto_class=tf.AutoModelForSequenceClassification, vocab_size=258,
                          num_labels=len(labels), id2label=dict(enumerate(labels)), pad_token_id=None)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 256), ("</s>", 257)])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    return model


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """(path, transformers model, transformers tokenizer) of a Qwen3 cross-encoder."""
    path = str(tmp_path_factory.mktemp("qwen3_cross_encoder"))
    model = save_classifier("qwen3_qk_norm", path, ["relevant"])
    return path, model, tf.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def server(cross_encoder, tmp_path_factory):
    yield from server_harness.serving(str(tmp_path_factory.mktemp("served")), cross_encoder[0],
                                      "--served-model-name", "ce", **ENGINE)


def pair_scores(cross_encoder, text_1: list[str], text_2: list[str]) -> np.ndarray:
    """transformers' sigmoid of each pair's logit, the pair laid out by its tokenizer."""
    _, model, tokenizer = cross_encoder
    return np.array([sigmoid(hf_logits(model, tokenizer(a, b)["input_ids"])[0]) for a, b in zip(text_1, text_2)])


@pytest.mark.parametrize("route, text_1, text_2", [
    ("/score", QUERY, DOCUMENTS[0]),                      # 1:1
    ("/v1/score", QUERY, DOCUMENTS),                      # 1:N, over two windows of max_num_seqs
    ("/score", DOCUMENTS[:3], DOCUMENTS[1:]),             # N:N
])
def test_score_route_matches_transformers(server, cross_encoder, route, text_1, text_2):
    body = requests.post(server.url + route, json={"model": "ce", "text_1": text_1, "text_2": text_2}).json()
    first, second = ([t] if isinstance(t, str) else t for t in (text_1, text_2))
    first = first * len(second) if len(first) == 1 else first
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(len(second))]
    np.testing.assert_allclose([d["score"] for d in body["data"]], pair_scores(cross_encoder, first, second),
                               atol=1e-5)
    tokens = sum(len(cross_encoder[2](a, b)["input_ids"]) for a, b in zip(first, second))
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    assert body["model"] == "ce" and body["object"] == "list"


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_route_sorts_documents_by_relevance(server, cross_encoder, route):
    want = pair_scores(cross_encoder, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    best = list(np.argsort(-want))
    body = requests.post(server.url + route, json={"query": QUERY, "documents": DOCUMENTS}).json()
    assert [r["index"] for r in body["results"]] == best
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in best]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], want[best], atol=1e-5)
    assert body["usage"]["total_tokens"] == sum(len(cross_encoder[2](QUERY, d)["input_ids"]) for d in DOCUMENTS)
    top = requests.post(server.url + route, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                                  "return_documents": False}).json()
    assert top["results"] == [{"index": int(i), "relevance_score": r["relevance_score"]}
                              for i, r in zip(best[:2], body["results"])]


def test_classify_route_matches_transformers(server, cross_encoder):
    """One label: its probability is the sigmoid of its logit (vLLM's), its name id2label's."""
    _, model, tokenizer = cross_encoder
    body = requests.post(server.url + "/classify", json={"input": DOCUMENTS[:3]}).json()
    for i, (d, text) in enumerate(zip(body["data"], DOCUMENTS)):
        assert (d["index"], d["label"], d["num_classes"]) == (i, "relevant", 1)
        np.testing.assert_allclose(d["probs"], sigmoid(hf_logits(model, tokenizer(text)["input_ids"])), atol=1e-5)
    # vLLM's `messages`: one conversation through the chat template, without a generation prompt
    conversation = [{"role": "user", "content": DOCUMENTS[0]}]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=True, return_dict=False)
    (d,) = requests.post(server.url + "/classify", json={"messages": conversation}).json()["data"]
    np.testing.assert_allclose(d["probs"], sigmoid(hf_logits(model, ids)), atol=1e-5)


@pytest.mark.parametrize("route, body, param", [
    ("/score", {"text_2": "a"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),   # neither 1:N nor N:N
    ("/v1/score", {"text_1": "a", "text_2": [1, 2]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": "b" * 200}, "text_2"),                # past max_model_len (128)
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model"),
    ("/rerank", {"documents": ["a"]}, "query"),
    ("/rerank", {"query": "a", "documents": "a"}, "documents"),
    ("/v2/rerank", {"query": "a", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ("/classify", {"input": []}, "input"),
    ("/classify", {"input": "a", "timeout": 0}, "timeout"),
    ("/v1/embeddings", {"input": "a"}, "model"),                               # a classifier embeds nothing
])
def test_routes_refuse_bad_bodies(server, route, body, param):
    r = requests.post(server.url + route, json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_classifier"))
    model = save_classifier("llama_gqa_rope3", path, ["negative", "neutral", "positive"])
    return LLM(path, **ENGINE), model


def test_classify_matches_transformers(classifier):
    """LLM.classify: the softmax of transformers' logits, in id2label's order; the engine's labels
    are id2label's; the three-label classifier scores nothing and embeds nothing."""
    llm, model = classifier
    assert llm.llm_engine.ecfg.runner == "pooling"   # auto, for a sequence classifier
    assert llm.llm_engine.pooler.labels == ("negative", "neutral", "positive")
    tokenizer = llm.get_tokenizer()
    outputs = llm.classify(DOCUMENTS + [[5, 6, 7]], use_tqdm=False)
    for out, prompt in zip(outputs, DOCUMENTS + [[5, 6, 7]]):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        logits = hf_logits(model, ids)
        assert out.prompt_token_ids == ids and out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, np.exp(logits) / np.exp(logits).sum(), atol=1e-5)
        # /classify's label: the likeliest
        assert scoring.classification(np.log(out.outputs.probs), llm.llm_engine.pooler.labels)[0] == \
            ["negative", "neutral", "positive"][int(np.argmax(logits))]
    with pytest.raises(InvalidRequest, match="3 labels") as e:
        llm.score("a", "b", use_tqdm=False)
    assert e.value.param == "model"
    with pytest.raises(InvalidRequest, match="not embeddings"):
        llm.embed("a", use_tqdm=False)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A Mistral base model (MistralModel: LAST pooling, normalized) and its transformers model."""
    model = save_hf_model("mistral_window", str(tmp_path_factory.mktemp("mistral")), vocab_size=258).eval()
    path = str(tmp_path_factory.mktemp("mistral_base"))
    model.model.save_pretrained(path)
    save_byte_tokenizer(path)
    return LLM(path, **ENGINE), model


def test_embedding_model_scores_cosine_similarity(embedder):
    """LLM.score on an embedding model: each text embedded alone, the cosine of transformers' last
    hidden states; 1:N and N:N; and it classifies nothing."""
    llm, model = embedder
    tokenizer = llm.get_tokenizer()

    def last_hidden(text):
        with torch.no_grad():
            return model.model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1].double().numpy()

    def cosine(a, b):
        return last_hidden(a) @ last_hidden(b) / np.linalg.norm(last_hidden(a)) / np.linalg.norm(last_hidden(b))

    for text_1, text_2 in ((QUERY, DOCUMENTS), (DOCUMENTS[:3], DOCUMENTS[1:])):
        first = [text_1] * len(text_2) if isinstance(text_1, str) else text_1
        outputs = llm.score(text_1, text_2, use_tqdm=False)
        np.testing.assert_allclose([o.outputs.score for o in outputs], [cosine(a, b) for a, b in zip(first, text_2)],
                                   atol=1e-5)
        assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(a) + tokenizer.encode(b)
                                                         for a, b in zip(first, text_2)]
    with pytest.raises(InvalidRequest, match="no classification head"):
        llm.classify("a", use_tqdm=False)


def test_score_pairing_and_refusals():
    """score_run's pairing, without an engine: a generate engine (no pooler) scores nothing."""
    with pytest.raises(InvalidRequest, match="1:1, 1:N or N:N"):
        scoring.score_run(None, None, ["a", "b"], ["c"])
    with pytest.raises(InvalidRequest, match="runner pooling") as e:
        scoring.score_run(None, None, ["a"], ["c"])
    assert e.value.param == "model"
    with pytest.raises(InvalidRequest, match="task"):
        PoolingParams(task="score")
    np.testing.assert_allclose(scoring.probabilities([0.0, np.log(3)]), [0.25, 0.75])
    assert json.dumps(scoring.probabilities([2.0])) == json.dumps([float(sigmoid(2.0))])


QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}   # vLLM's hf_overrides for Qwen3-Reranker


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_reranker_scores_yes_against_no(tied, tmp_path):
    """A Qwen3ForCausalLM with vLLM's Qwen3-Reranker hf_overrides: one label whose head is the LM
    head's "yes" row minus its "no" row, so its sigmoid on our last hidden state is transformers'
    softmax of the last token's (no, yes) logits at "yes" (0.6B ties its head, the larger ones do not)."""
    path = str(tmp_path)
    model = save_hf_model("qwen3_qk_norm", path, vocab_size=260, tie_word_embeddings=tied)
    save_byte_tokenizer(path)
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.add_tokens(["no", "yes"])   # one id each, as in Qwen's vocabulary
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    ecfg, cfg, pooler = pooling.configure(EngineConfig(model=path, hf_overrides=QWEN3_RERANKER), path)
    assert (ecfg.runner, cfg.architecture, pooler.labels) == ("pooling", "Qwen3ForSequenceClassification", ("yes",))
    ids = tokenizer.encode(QUERY + DOCUMENTS[0]).ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
    no, yes = logits[tokenizer.token_to_id("no")], logits[tokenizer.token_to_id("yes")]
    flax_model = build_model(cfg)
    hidden, _ = flax_model.apply({"params": checkpoint.load_params(path, cfg)}, np.array([ids]), np.arange(len(ids))[None])
    np.testing.assert_allclose(scoring.probabilities(pooler.classifier @ np.asarray(hidden[0, -1])),
                               [np.exp(yes) / (np.exp(no) + np.exp(yes))], atol=1e-5)

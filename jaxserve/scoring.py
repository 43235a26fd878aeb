"""vLLM's classify, score and rerank over a pooling engine's outputs (jaxserve/pooling.py), shared
by the offline API (LLM.classify, LLM.score) and the server's routes (server/score_api.py).

classify: a sequence classifier's label logits as probabilities: softmax over the labels, or the
sigmoid of a lone label's logit (vLLM's). score: each text of text_1 against each of text_2,
1:1, 1:N or N:N. A cross-encoder (a classifier of one label) runs each pair as one prompt, laid
out as the tokenizer lays out a pair (`tokenizer(text_1, text_2)`), and scores the sigmoid of its
logit; an embedding model embeds each text alone and scores the cosine similarity of the two
embeddings. rerank scores a query against documents.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sampling_params import InvalidRequest


def probabilities(logits: list[float]) -> list[float]:
    x = np.asarray(logits, np.float64)
    if len(x) == 1:
        return (1 / (1 + np.exp(-x))).tolist()
    e = np.exp(x - x.max())
    return (e / e.sum()).tolist()


def classification(logits: list[float], labels: tuple[str, ...]) -> tuple[str, list[float]]:
    """(the likeliest label, the probabilities) of a classifier's label logits."""
    probs = probabilities(logits)
    return labels[int(np.argmax(probs))], probs


def cosine(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


@dataclasses.dataclass(frozen=True)
class ScoreRun:
    """What scores text_1 against text_2: the pooling task and prompts to run, and for each score
    the prompts it reads (one: a cross-encoder's pair; two: the texts' embeddings)."""
    task: str
    prompts: list[list[int]]
    scored: list[tuple[int, ...]]

    def scores(self, pooled: list[list[float]]) -> list[float]:
        """Each score, from the prompts' outputs (RequestOutput.pooled) in order."""
        def score(read: tuple[int, ...]) -> float:
            if len(read) == 1:   # a cross-encoder's logit
                return probabilities(pooled[read[0]])[0]
            return cosine(pooled[read[0]], pooled[read[1]])
        return [score(read) for read in self.scored]


def score_run(pooler, tokenizer, text_1: list[str], text_2: list[str]) -> ScoreRun:
    """The run that scores text_1 against text_2 on an engine with this pooler (None: runner
    generate). Raises InvalidRequest, naming the field at fault, for lengths that are not 1:1, 1:N
    or N:N, or a model that does not score."""
    for name, texts in (("text_1", text_1), ("text_2", text_2)):
        if not texts:
            raise InvalidRequest(f"{name} holds no text", param=name)
    if len(text_1) not in (1, len(text_2)):
        raise InvalidRequest(f"text_1 has {len(text_1)} texts and text_2 {len(text_2)}: score pairs them 1:1, "
                             "1:N or N:N", param="text_1")
    if pooler is None:
        raise InvalidRequest("this model does not score: start it with runner pooling", param="model")
    firsts = [0] * len(text_2) if len(text_1) == 1 else range(len(text_2))
    if pooler.classifier is None:   # embeddings: text_1's, then text_2's
        prompts = [tokenizer.encode(t) for t in text_1 + text_2]
        return ScoreRun("embed", prompts, [(i, len(text_1) + j) for j, i in enumerate(firsts)])
    if len(pooler.labels) != 1:
        raise InvalidRequest(f"this classifier has {len(pooler.labels)} labels: scores come from a cross-encoder "
                             "(one label) or an embedding model", param="model")
    prompts = [tokenizer.encode_pair(text_1[i], t) for i, t in zip(firsts, text_2)]
    return ScoreRun("classify", prompts, [(k,) for k in range(len(prompts))])

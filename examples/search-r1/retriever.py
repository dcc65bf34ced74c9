"""A local retriever over data/corpus.jsonl: BM25 in pure Python, in the shape of Search-R1's retrieval server.

It stands in for the dense retriever (an e5 index over Wikipedia) or the web search of slime's search-r1 example:
`search(query, topk)` answers what that server's /retrieve answers for one query, a list of
`{"document": {"id", "contents"}, "score"}`, best first, where `contents` is '"Title"\\ntext'.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from functools import cache
from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "corpus.jsonl"
_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset("a an and are as at by did do does for from how in is it its of on or the to was what which who "
                  "with".split())


def terms(text: str) -> list[str]:
    """Lower-cased words, without the commonest English words."""
    return [word for word in _WORD.findall(text.lower()) if word not in _STOP]


class Bm25Index:
    """Okapi BM25 (k1, b as usual) over a list of documents."""

    def __init__(self, documents: list[dict], k1: float = 1.2, b: float = 0.75):
        if not documents:
            raise ValueError("Bm25Index: the corpus is empty; give at least one document")
        self.documents, self.k1, self.b = documents, k1, b
        self.counts = [Counter(terms(doc["contents"])) for doc in documents]
        self.lengths = [sum(counts.values()) for counts in self.counts]
        self.mean_length = sum(self.lengths) / len(self.lengths)
        frequency = Counter(term for counts in self.counts for term in counts)
        n = len(documents)
        self.idf = {term: math.log(1 + (n - df + 0.5) / (df + 0.5)) for term, df in frequency.items()}

    def score(self, query: list[str], i: int) -> float:
        counts, norm = self.counts[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.mean_length)
        return sum(self.idf[t] * counts[t] * (self.k1 + 1) / (counts[t] + norm) for t in query if t in counts)

    def search(self, query: str, topk: int) -> list[dict]:
        """The `topk` best documents for `query` (ties and a query with no known word: corpus order), with scores."""
        words = terms(query)
        scores = [self.score(words, i) for i in range(len(self.documents))]
        best = sorted(range(len(scores)), key=lambda i: -scores[i])[:topk]
        return [{"document": self.documents[i], "score": scores[i]} for i in best]


@cache
def default_index() -> Bm25Index:
    """The index of the shipped corpus (built once per process)."""
    with CORPUS.open() as f:
        return Bm25Index([json.loads(line) for line in f if line.strip()])


def search(query: str, topk: int = 3) -> list[dict]:
    """Search the shipped corpus: Search-R1's /retrieve result for one query."""
    return default_index().search(query, topk)

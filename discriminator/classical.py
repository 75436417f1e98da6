"""scikit-learn detectors: fast (seconds on 2 x 1,000 turns), deterministic, and of different families from the neural
one, so the panel does not share one model's blind spots.

- `ClassicalDetector`: character and word n-gram TF-IDF of the user turn plus the style features, into logistic
  regression.
- `StyleDetector`: the style features alone, into gradient-boosted trees (catches non-linear combinations such as
  "long, markdown, and answers a short question").

Both score with log-odds that an item is real (label 1), like `NeuralDetector`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from conversations import DataError, TurnRecord
from discriminator.features import style_features


def check_labels(items: Sequence[TurnRecord], labels) -> np.ndarray:
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(y) != len(items):
        raise DataError(f"{len(items)} items but {len(y)} labels")
    if len(y) and not np.isin(y, (0, 1)).all():
        raise DataError("labels must be 1 (real) or 0 (simulated)")
    return y


def _one_thread():
    """OpenMP with 2 threads on 2 shared cores runs gradient boosting ~10x slower than 1 thread (spin-waiting); these
    models are small, so one thread is also the fast choice on a big machine."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


class _SklearnDetector:
    name = "sklearn"

    def __init__(self) -> None:
        self._model = None

    def _check_fit(self, items, labels) -> np.ndarray:
        y = check_labels(items, labels)
        if len(np.unique(y)) < 2:
            raise DataError(f"{self.name} detector needs both real (1) and simulated (0) items to fit")
        return y

    def _check_fitted(self) -> None:
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit(items, labels) first")

    def _features(self, items: Sequence[TurnRecord]):
        """The fitted family's features of `items` (what its model's decision_function takes)."""
        raise NotImplementedError

    def score(self, items: Sequence[TurnRecord]) -> np.ndarray:
        """Log-odds that each item is real, float64 [n]."""
        self._check_fitted()
        if not len(items):
            return np.zeros(0)
        X = self._features(items)
        with _one_thread():
            return np.asarray(self._model.decision_function(X), dtype=np.float64).reshape(-1)

    def predict_proba(self, items: Sequence[TurnRecord]) -> np.ndarray:
        """P(real) per item, [n]."""
        return _sigmoid(self.score(items))


class ClassicalDetector(_SklearnDetector):
    """TF-IDF n-grams (characters keep casing and punctuation, words catch phrasing) plus style features, into
    L2-regularised logistic regression with balanced class weights."""

    name = "classical"

    def __init__(
        self,
        char_ngrams: tuple[int, int] = (1, 4),
        word_ngrams: tuple[int, int] = (1, 2),
        max_features: int = 50_000,
        min_df: int = 2,
        C: float = 2.0,
        style: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.char_ngrams = tuple(char_ngrams)
        self.word_ngrams = tuple(word_ngrams)
        self.max_features = max_features
        self.min_df = min_df
        self.C = C
        self.style = style
        self.seed = seed

    def _featurize(self, items: Sequence[TurnRecord], fit: bool, y=None):
        from scipy import sparse

        texts = [it.user_turn for it in items]
        if fit:
            from sklearn.feature_extraction.text import TfidfVectorizer
            from sklearn.preprocessing import StandardScaler

            # min_df counts documents: on tiny fits (tests, the loop's ~100 items) fall back to 1 so the vocabulary is
            # never empty
            min_df = self.min_df if len(texts) >= 50 else 1
            self._char = TfidfVectorizer(
                analyzer="char", ngram_range=self.char_ngrams, lowercase=False, sublinear_tf=True,
                min_df=min_df, max_features=self.max_features, dtype=np.float32,
            )
            self._word = TfidfVectorizer(
                analyzer="word", ngram_range=self.word_ngrams, lowercase=True, sublinear_tf=True,
                min_df=min_df, max_features=self.max_features, token_pattern=r"(?u)\b\w+\b|[^\w\s]", dtype=np.float32,
            )
            blocks = [self._char.fit_transform(texts), self._word.fit_transform(texts)]
            if self.style:
                self._scaler = StandardScaler()
                blocks.append(sparse.csr_matrix(self._scaler.fit_transform(style_features(items))))
        else:
            blocks = [self._char.transform(texts), self._word.transform(texts)]
            if self.style:
                blocks.append(sparse.csr_matrix(self._scaler.transform(style_features(items))))
        return sparse.hstack(blocks, format="csr")

    def fit(self, items: Sequence[TurnRecord], labels) -> "ClassicalDetector":
        from sklearn.linear_model import LogisticRegression

        y = self._check_fit(items, labels)
        X = self._featurize(items, fit=True)
        self._model = LogisticRegression(
            C=self.C, class_weight="balanced", max_iter=2000, solver="liblinear", random_state=self.seed
        )
        with _one_thread():
            self._model.fit(X, y)
        return self

    def _features(self, items: Sequence[TurnRecord]):
        return self._featurize(items, fit=False)

    def cues(self, k: int = 10) -> dict[str, list[tuple[str, float]]]:
        """The word n-grams that weigh most toward each side, `{"real": [(ngram, weight)], "simulated": [...]}`:
        what this fitted detector keys on (the character n-grams and style features are left out: they read
        poorly)."""
        self._check_fitted()
        coef = np.asarray(self._model.coef_, dtype=np.float64).reshape(-1)  # [char | word | style]
        n_char = len(self._char.vocabulary_)
        words = self._word.get_feature_names_out()
        w = coef[n_char:n_char + len(words)]
        order = np.argsort(w)
        return {"real": [(str(words[i]), float(w[i])) for i in order[::-1][:k]],
                "simulated": [(str(words[i]), float(w[i])) for i in order[:k]]}


class StyleDetector(_SklearnDetector):
    """Gradient-boosted trees over the style features only (no vocabulary): a different family from the n-gram model."""

    name = "style"

    def __init__(
        self,
        max_iter: int = 200,
        learning_rate: float = 0.08,
        max_leaf_nodes: int = 15,
        l2_regularization: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.max_leaf_nodes = max_leaf_nodes
        self.l2_regularization = l2_regularization
        self.seed = seed

    def fit(self, items: Sequence[TurnRecord], labels) -> "StyleDetector":
        from sklearn.ensemble import HistGradientBoostingClassifier

        y = self._check_fit(items, labels)
        self._model = HistGradientBoostingClassifier(
            max_iter=self.max_iter,
            learning_rate=self.learning_rate,
            max_leaf_nodes=self.max_leaf_nodes,
            min_samples_leaf=min(20, max(2, len(y) // 20)),
            l2_regularization=self.l2_regularization,
            early_stopping=False,
            class_weight="balanced",
            random_state=self.seed,
        )
        X = style_features(items)
        with _one_thread():
            self._model.fit(X, y)
        return self

    def _features(self, items: Sequence[TurnRecord]):
        return style_features(items)

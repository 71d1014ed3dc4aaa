"""Accuracy: an `evaluate` module shipped with `dat_hf.training` (the Hub's `accuracy` metric needs the network).

Load it offline with `dat_hf.training.load_metric("accuracy")` (a local folder). Same inputs and outputs as the Hub's
`accuracy` metric, computed with NumPy (no scikit-learn needed).
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
Accuracy is the proportion of correct predictions among all predictions: (TP + TN) / (TP + TN + FP + FN) for binary
labels, the fraction of exact matches for multi-class labels. With `sample_weight`, each example counts its weight.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    normalize (`bool`, *optional*, defaults to `True`): return the fraction of correct predictions; if `False`, the
        number (or total weight) of correct predictions.
    sample_weight (`list` of `float`, *optional*): per-example weights.
Returns:
    accuracy (`float` or `int`): the fraction (or count) of correct predictions.
Examples:
    >>> accuracy = load_metric("accuracy")  # from dat_hf.training
    >>> accuracy.compute(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0])
    {'accuracy': 0.5}
"""

_CITATION = """\
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and others},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        predictions, references = np.asarray(predictions), np.asarray(references)
        if predictions.shape != references.shape:
            raise ValueError(f"`predictions` ({predictions.shape}) and `references` ({references.shape}) differ in size.")
        correct = (predictions == references).astype(np.float64)
        weights = np.ones_like(correct) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        total = float((correct * weights).sum())
        if normalize:
            if weights.sum() == 0:
                raise ValueError("Accuracy of an empty set (or zero total weight) is undefined.")
            return {"accuracy": total / float(weights.sum())}
        return {"accuracy": int(total) if sample_weight is None else total}

"""Exact-match accuracy for generated text, shipped with dat_hf so it loads offline:

    >>> from dat_hf.training import load_metric
    >>> metric = load_metric("exact_match")     # a local folder: no Hub access
    >>> metric.compute(predictions=["7", "x"], references=["7", "y"])
    {'exact_match': 0.5}
"""

import datasets
import evaluate

_DESCRIPTION = """Fraction of predictions equal to their reference string (after optional stripping of surrounding
whitespace and lower-casing). Used for the math problem-solving task: an answer is right only if it is exactly the
reference answer."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): generated answers.
    references (`list[str]`): reference answers.
    strip (`bool`, defaults to `True`): strip surrounding whitespace before comparing.
    ignore_case (`bool`, defaults to `False`): compare lower-cased strings.
Returns:
    exact_match (`float`): fraction of exact matches in [0, 1] (0.0 for empty inputs).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references, strip=True, ignore_case=False):
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions but {len(references)} references.")
        if not predictions:
            return {"exact_match": 0.0}

        def norm(text):
            text = text.strip() if strip else text
            return text.lower() if ignore_case else text

        hits = sum(norm(p) == norm(r) for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}

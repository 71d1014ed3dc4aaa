"""Perplexity from per-token negative log-likelihoods: an `evaluate` module shipped with `dat_hf.training`.

Load it offline with `dat_hf.training.load_metric("perplexity")` (a local folder; the Hub's `perplexity` metric
needs the network and re-runs a model from a Hub id). Unlike the Hub metric, this one takes what a training loop already has:
the negative log-likelihood (natural log) of every predicted token, one list per sequence.
"""

import math

import datasets
import evaluate
import numpy as np

_CITATION = """\
@article{jelinek1977perplexity,
  title={Perplexity---a measure of the difficulty of speech recognition tasks},
  author={Jelinek, Fred and Mercer, Robert L and Bahl, Lalit R and Baker, James K},
  journal={The Journal of the Acoustical Society of America},
  volume={62},
  number={S1},
  pages={S63--S63},
  year={1977}
}
"""

_DESCRIPTION = """\
Perplexity of a causal language model: exp of the mean negative log-likelihood per token. `perplexity` is the
corpus-level value (every token weighs the same), `mean_perplexity` the mean over sequences of each sequence's
perplexity (as the Hub's `perplexity` metric reports), `perplexities` the per-sequence values.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `list` of `float`): for each sequence, the negative log-likelihood (natural log) of each
        predicted token, e.g. `cross_entropy(logits[:, :-1], labels[:, 1:], reduction="none")` with ignored positions
        removed. Sequences may have different lengths; empty sequences are skipped.
    base (`float`, *optional*): report perplexity in this base instead of e (`base=2` gives 2 ** bits-per-token);
        the value is the same, only `nll` changes unit.
Returns:
    perplexity (`float`): exp(total NLL / number of tokens).
    mean_perplexity (`float`): mean of the per-sequence perplexities.
    perplexities (`list` of `float`): per-sequence perplexities.
    nll (`float`): mean NLL per token (nats, or log_base units when `base` is given).
    num_tokens (`int`): number of tokens scored.
Examples:
    >>> perplexity = load_metric("perplexity")  # from dat_hf.training
    >>> results = perplexity.compute(predictions=[[0.0, 0.0], [math.log(4.0)]])
    >>> round(results["perplexity"], 4), round(results["mean_perplexity"], 4)
    (1.5874, 2.5)
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("float64"))}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(self, predictions, base=None):
        sums, counts = [], []
        for row in predictions:
            values = np.asarray(row, dtype=np.float64)
            values = values[~np.isnan(values)]
            if values.size:
                sums.append(values.sum())
                counts.append(values.size)
        if not counts:
            raise ValueError("No token NLL to score: `predictions` is empty.")
        sums, counts = np.asarray(sums), np.asarray(counts)
        mean_nll = float(sums.sum() / counts.sum())
        perplexities = np.exp(sums / counts)
        return {
            "perplexity": float(math.exp(mean_nll)),
            "mean_perplexity": float(perplexities.mean()),
            "perplexities": perplexities.tolist(),
            "nll": mean_nll / math.log(base) if base else mean_nll,
            "num_tokens": int(counts.sum()),
        }

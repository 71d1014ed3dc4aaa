"""Look at DAT's relational inductive biases instead of reading tensors.

1. Every bias's attention graph, as built by `dat_hf.masking_dat` (the masks the models use), for a given length:
   `bias_<name>.png` shows the mask matrix (row i = receiver, column j = sender; dark = i attends to j) next to the same
   graph drawn as nodes and arrows. `graph` uses an example graph (a connected Watts-Strogatz graph from networkx,
   or Zachary's karate club with `--graph karate`); `bipartite` is encoder-decoder cross-attention.
2. With `--model FOLDER` (a saved DAT model) or `--config FILE` (a config, random weights), for one input: per layer,
   the sensory heads' attention (`layer<l>_sensory.png`), the relational heads' attention (`layer<l>_relational.png`)
   and the relations r(x_i, x_j) (`layer<l>_relations.png`), one panel per head or relation component.

    python scripts/plot_relational_biases.py --output-dir plots --length 16
    python scripts/plot_relational_biases.py --output-dir plots --config dat-tiny --input-ids 5 8 13 21
    python scripts/plot_relational_biases.py --output-dir plots --model my-dat-folder --text "the cat sat"
"""

import argparse
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
import torch  # noqa: E402

import dat_hf  # noqa: E402,F401  (registers the Auto classes)
from dat_hf import DATEncoderConfig  # noqa: E402
from dat_hf.masking_dat import build_attention_mask, build_cross_attention_mask  # noqa: E402

BIASES = ("full", "causal", "sliding_window", "sliding_window_bidirectional", "sparse", "graph", "bipartite")
DESCRIPTIONS = {
    "full": "complete graph (symmetry: permutations)",
    "causal": "total order (symmetry: translations)",
    "sliding_window": "p previous tokens (symmetry: translations)",
    "sliding_window_bidirectional": "|i - j| <= p (symmetry: translations)",
    "sparse": "fixed graph: blocks + global tokens + edges",
    "graph": "graph given with each input (symmetry: its relabellings)",
    "bipartite": "encoder-decoder (symmetry: block permutations)",
}


# ---- masks --------------------------------------------------------------------------------------------------------
def example_graph(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """A bool adjacency [n, n] (symmetric, no self loops): `watts_strogatz` (connected, n nodes) or `karate` (the
    first n members of Zachary's karate club)."""
    if kind == "karate":
        graph = nx.karate_club_graph().subgraph(range(min(n, 34)))
    else:
        graph = nx.connected_watts_strogatz_graph(n, k=min(4, n - 1), p=0.3, seed=seed)
    adjacency = torch.zeros(n, n, dtype=torch.bool)
    for i, j in graph.edges():
        adjacency[i, j] = adjacency[j, i] = True
    return adjacency


def _allowed(mask, q_len: int, kv_len: int) -> torch.Tensor:
    """An `AttentionMask` -> bool [q, kv] (True = attends; receivers without senders get an empty row)."""
    if mask.mask is None:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
        if mask.is_causal:
            allowed = allowed.tril(kv_len - q_len)
    else:
        m = mask.mask[0, 0]
        allowed = m if m.dtype == torch.bool else m == 0
    if mask.row_valid is not None:
        allowed = allowed & mask.row_valid[0, 0]
    return allowed.cpu()


def bias_mask(bias: str, n: int, window: int = 3, block_size: int = 4, global_tokens: int = 1, sparse_edges=None,
              adjacency: torch.Tensor | None = None, source_length: int | None = None,
              causal: bool = False) -> torch.Tensor:
    """The bool [n, n] mask (or [n, source_length] for `bipartite`) that dat_hf builds for `bias`. `causal=True`
    shows what a decoder (causal LM) uses: every bias intersected with the causal order."""
    config = DATEncoderConfig(
        hidden_size=8, num_hidden_layers=1, num_sensory_heads=1, num_relational_heads=1, intermediate_size=8,
        num_symbols=1, symbolic_attention_heads=1, max_position_embeddings=max(n, source_length or 0, 1),
        sliding_window_size=window, sparse_block_size=block_size, sparse_global_tokens=global_tokens,
        sparse_edges=sparse_edges, vocab_size=1,
    )
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(1, n, 8)
    if bias == "bipartite":
        source = torch.zeros(1, source_length or n, 8)
        mask = build_cross_attention_mask(config, embeds, source, torch.ones(1, source.shape[1], dtype=torch.long))
        return _allowed(mask, n, source.shape[1])
    adjacency = None if adjacency is None else adjacency[None]
    mask = build_attention_mask(bias, config, embeds, None, graph_adjacency=adjacency, causal=causal)
    return _allowed(mask, n, n)


def plot_bias(bias: str, allowed: torch.Tensor, path: str, adjacency: torch.Tensor | None = None, title=None):
    """Matrix (left) and node-link drawing (right) of one bias's graph."""
    q_len, kv_len = allowed.shape
    fig, (ax_m, ax_g) = plt.subplots(1, 2, figsize=(10, 4.8), gridspec_kw={"width_ratios": [1, 1.15]})
    ax_m.imshow(allowed.float().numpy(), cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest")
    ax_m.set_xlabel("sender j" if bias != "bipartite" else "source token j")
    ax_m.set_ylabel("receiver i" if bias != "bipartite" else "target token i")
    ticks = lambda length: range(0, length, max(1, math.ceil(length / 16)))  # noqa: E731
    ax_m.set_xticks(list(ticks(kv_len)))
    ax_m.set_yticks(list(ticks(q_len)))
    ax_m.set_xticks([x - 0.5 for x in range(1, kv_len)], minor=True)
    ax_m.set_yticks([y - 0.5 for y in range(1, q_len)], minor=True)
    ax_m.grid(which="minor", color="white", linewidth=0.5)
    ax_m.tick_params(which="minor", length=0)
    ax_m.set_title(f"mask ({int(allowed.sum())} edges)")

    graph = nx.DiGraph()
    if bias == "bipartite":
        sources = [f"s{j}" for j in range(kv_len)]
        targets = [f"t{i}" for i in range(q_len)]
        graph.add_nodes_from(sources + targets)
        graph.add_edges_from((sources[j], targets[i]) for i, j in allowed.nonzero().tolist())
        pos = {**{s: (0, -k) for k, s in enumerate(sources)}, **{t: (1, -k * (kv_len - 1) / max(1, q_len - 1))
                                                                  for k, t in enumerate(targets)}}
        colors = ["#f4a582"] * kv_len + ["#92c5de"] * q_len
    else:
        graph.add_nodes_from(range(q_len))
        # an edge j -> i when receiver i attends to sender j (self loops left out of the drawing)
        graph.add_edges_from((j, i) for i, j in allowed.nonzero().tolist() if i != j)
        if bias == "graph" and adjacency is not None:
            pos = nx.spring_layout(nx.from_numpy_array(adjacency.int().numpy()), seed=0)
        else:
            pos = nx.circular_layout(graph)
        colors = ["#92c5de"] * q_len
    nx.draw_networkx_nodes(graph, pos, ax=ax_g, node_size=180, node_color=colors, edgecolors="#2166ac")
    nx.draw_networkx_labels(graph, pos, ax=ax_g, font_size=7)
    dense = graph.number_of_edges() > 120
    nx.draw_networkx_edges(graph, pos, ax=ax_g, arrows=True, arrowsize=4 if dense else 8, width=0.3 if dense else 0.7,
                           alpha=0.4 if dense else 0.55, node_size=180, connectionstyle="arc3,rad=0.08")
    ax_g.set_title("graph (arrow j -> i: i attends to j)" if bias != "bipartite" else "source -> target")
    ax_g.axis("off")
    fig.suptitle(title or f"{bias}: {DESCRIPTIONS[bias]}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_biases(output_dir, length=16, biases=BIASES, window=3, block_size=4, global_tokens=1, sparse_edges=None,
                graph="watts_strogatz", source_length=None, causal=False, seed=0) -> list[str]:
    """Write `bias_<name>.png` for every bias; returns the paths."""
    os.makedirs(output_dir, exist_ok=True)
    adjacency = example_graph(graph, length, seed)
    paths = []
    for bias in biases:
        allowed = bias_mask(bias, length, window, block_size, global_tokens, sparse_edges, adjacency,
                            source_length, causal)
        details = {"sliding_window": f" p={window}", "sliding_window_bidirectional": f" p={window}",
                   "sparse": f" block={block_size}, global={global_tokens}" + (" + edges" if sparse_edges else ""),
                   "graph": f" ({graph} example)"}.get(bias, "")
        title = f"{bias}{details}: {DESCRIPTIONS[bias]}" + (" & causal order" if causal and bias != "bipartite" else "")
        paths.append(plot_bias(bias, allowed, os.path.join(output_dir, f"bias_{bias}.png"),
                               adjacency if bias == "graph" else None, title))
    return paths


# ---- a model's attention ------------------------------------------------------------------------------------------
def load_model(model_path=None, config_path=None, seed=0, overrides=None):
    """The DAT base model (DATModel or DATEncoderModel) of a saved folder, or a randomly initialised one from a config
    file or preset name (`model_type` defaults to `dat`, keys starting with `_` are comments; `overrides` replace
    fields), in eval mode with eager attention (so that attention weights are returned)."""
    import json

    from transformers import AutoConfig, AutoModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from dat_hf.training import preset_path

    if model_path is not None:
        return AutoModel.from_pretrained(model_path, attn_implementation="eager", **(overrides or {})).eval()
    with open(preset_path(config_path)) as f:
        fields = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    fields.update(overrides or {})
    model_type = fields.pop("model_type", "dat")
    config = CONFIG_MAPPING[model_type](**fields) if model_type in CONFIG_MAPPING else AutoConfig.for_model(
        model_type, **fields)
    torch.manual_seed(seed)
    return AutoModel.from_config(config, attn_implementation="eager").eval()


def _heatmaps(matrices, titles, path, suptitle, cmap, symmetric=False, tokens=None):
    count = len(matrices)
    cols = min(count, 4)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 0.6, 3.4 * rows + 0.6), squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    for ax, matrix, title in zip(axes.flat, matrices, titles):
        matrix = matrix.float().cpu().numpy()
        if symmetric:
            bound = max(abs(matrix.min()), abs(matrix.max()), 1e-8)
            image = ax.imshow(matrix, cmap=cmap, vmin=-bound, vmax=bound, interpolation="nearest")
        else:
            image = ax.imshow(matrix, cmap=cmap, vmin=0, interpolation="nearest")
        ax.set_title(title, fontsize=10)
        n_q, n_k = matrix.shape
        if tokens is not None and len(tokens) == n_k and n_k <= 24:
            ax.set_xticks(range(n_k), tokens, rotation=90, fontsize=7)
            ax.set_yticks(range(n_q), tokens[-n_q:], fontsize=7)
        ax.set_xlabel("sender j", fontsize=8)
        ax.set_ylabel("receiver i", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(suptitle, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_model_attention(model, input_ids, output_dir, graph_adjacency=None, tokens=None) -> list[str]:
    """For one input sequence (input_ids [1, n]), write per layer the sensory attention, relational attention and
    relations heat maps; returns the paths."""
    os.makedirs(output_dir, exist_ok=True)
    config = model.config
    kwargs = {}
    layers = range(config.num_hidden_layers)
    if any("graph" in (config.layer_bias(i, False), config.layer_bias(i, True)) for i in layers):
        if graph_adjacency is None:
            graph_adjacency = example_graph("watts_strogatz", input_ids.shape[1]) | torch.eye(input_ids.shape[1],
                                                                                                dtype=torch.bool)
        kwargs["graph_adjacency"] = graph_adjacency[None] if graph_adjacency.dim() == 2 else graph_adjacency
    with torch.no_grad():
        out = model(input_ids=input_ids, output_attentions=True, use_cache=False, **kwargs)
    paths = []
    h_s = config.num_sensory_heads  # attentions: every head of a layer, sensory heads first
    for layer in range(config.num_hidden_layers):
        sensory_bias, relational_bias = config.layer_bias(layer, False), config.layer_bias(layer, True)
        if h_s > 0:
            weights = out.attentions[layer][0, :h_s]
            paths.append(_heatmaps(
                list(weights), [f"sensory head {h}" for h in range(weights.shape[0])],
                os.path.join(output_dir, f"layer{layer}_sensory.png"),
                f"layer {layer}: sensory attention ({sensory_bias})", "viridis", tokens=tokens))
        if config.num_relational_heads > 0:
            weights = out.attentions[layer][0, h_s:]
            paths.append(_heatmaps(
                list(weights), [f"relational head {h}" for h in range(weights.shape[0])],
                os.path.join(output_dir, f"layer{layer}_relational.png"),
                f"layer {layer}: relational attention ({relational_bias})", "magma", tokens=tokens))
            relations = out.relations[layer][0]
            paths.append(_heatmaps(
                list(relations), [f"relation {r}" for r in range(relations.shape[0])],
                os.path.join(output_dir, f"layer{layer}_relations.png"),
                f"layer {layer}: relations r(x_i, x_j) ({config.relation_activation})", "RdBu_r", symmetric=True,
                tokens=tokens))
    return paths


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--length", type=int, default=16, help="sequence length of the bias masks")
    parser.add_argument("--biases", nargs="*", default=list(BIASES), choices=BIASES)
    parser.add_argument("--window", type=int, default=3, help="sliding window p")
    parser.add_argument("--block-size", type=int, default=4, help="sparse: block size")
    parser.add_argument("--global-tokens", type=int, default=1, help="sparse: global tokens")
    parser.add_argument("--sparse-edges", type=int, nargs="*", default=None,
                        help="sparse: extra edges as a flat list receiver sender receiver sender ...")
    parser.add_argument("--graph", choices=["watts_strogatz", "karate"], default="watts_strogatz")
    parser.add_argument("--source-length", type=int, default=None, help="bipartite: source length (default: length)")
    parser.add_argument("--causal", action="store_true", help="show the masks of a decoder (causal order added)")
    parser.add_argument("--model", default=None, help="saved DAT model folder: plot its attention for one input")
    parser.add_argument("--config", default=None,
                        help="DAT config file or preset name (dat-tiny, ...): plot a randomly initialised model")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=JSON",
                        help='config overrides, e.g. relational_bias=\"sliding_window\" sliding_window_size=3')
    parser.add_argument("--input-ids", type=int, nargs="*", default=None, help="the input (default: random ids)")
    parser.add_argument("--text", default=None, help="the input as text (needs a tokenizer in --model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    edges = None
    if args.sparse_edges:
        if len(args.sparse_edges) % 2:
            parser.error("--sparse-edges needs pairs: receiver sender ...")
        edges = [args.sparse_edges[k:k + 2] for k in range(0, len(args.sparse_edges), 2)]
    paths = plot_biases(args.output_dir, args.length, args.biases, args.window, args.block_size, args.global_tokens,
                        edges, args.graph, args.source_length, args.causal, args.seed)
    if args.model or args.config:
        import json

        overrides = {}
        for item in args.set:
            field, _, value = item.partition("=")
            try:
                overrides[field] = json.loads(value)
            except json.JSONDecodeError:
                overrides[field] = value  # a bare string
        model = load_model(args.model, args.config, args.seed, overrides)
        tokens = None
        if args.text is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model)
            input_ids = tokenizer(args.text, return_tensors="pt").input_ids
            tokens = tokenizer.convert_ids_to_tokens(input_ids[0])
        elif args.input_ids:
            input_ids = torch.tensor([args.input_ids])
        else:
            generator = torch.Generator().manual_seed(args.seed)
            input_ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=generator)
        paths += plot_model_attention(model, input_ids, args.output_dir, tokens=tokens)
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main()

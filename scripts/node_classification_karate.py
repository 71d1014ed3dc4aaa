"""Node classification on Zachary's karate club with the `graph` relational bias (the GAT use case).

The graph ships with networkx: 34 members, 78 friendships, and the two factions the club split into ("Mr. Hi" and
"Officer"). Every DAT head (sensory and relational) attends only along friendships (plus each node to itself):
`relational_bias="graph"` with the adjacency passed as `graph_adjacency`, no position embedding and symbolic-attention
symbols, so the model is equivariant to relabelling the members.

Semi-supervised by default (as in the GCN/GAT papers): 4 members per faction are labelled (the two leaders among
them), the other 26 are predicted. With one-hot member ids as features, only the graph can carry the labels to the
unlabelled members: over seeds 0-4 the graph bias reaches 0.92 mean test accuracy, the `full` bias 0.49 (chance).

    python scripts/node_classification_karate.py                       # one-hot member ids, graph bias
    python scripts/node_classification_karate.py --bias full           # baseline: attention ignores the graph
    python scripts/node_classification_karate.py --features adjacency  # features: who each member knows
    python scripts/node_classification_karate.py --labelled all        # supervised: train on every member
"""

import argparse
import time

import networkx as nx
import torch

from dat_hf import DATEncoderConfig, DATForTokenClassification
from dat_hf.training import load_metric

FACTIONS = ["Mr. Hi", "Officer"]


def load_karate(self_loops: bool = True):
    """-> graph, adjacency bool [1, 34, 34], labels long [1, 34] (0 = Mr. Hi, 1 = Officer)."""
    graph = nx.karate_club_graph()
    n = graph.number_of_nodes()
    adjacency = torch.zeros(n, n, dtype=torch.bool)
    for i, j in graph.edges():
        adjacency[i, j] = adjacency[j, i] = True
    if self_loops:
        adjacency |= torch.eye(n, dtype=torch.bool)
    labels = torch.tensor([FACTIONS.index(graph.nodes[i]["club"]) for i in range(n)])
    return graph, adjacency[None], labels[None]


def node_features(graph, kind: str) -> torch.Tensor:
    """`onehot`: the member's id; `degree`: one-hot degree bucket plus normalised degree (structure only);
    `adjacency`: the member's row of the adjacency matrix (who it knows)."""
    n = graph.number_of_nodes()
    if kind == "onehot":
        return torch.eye(n)[None]
    if kind == "adjacency":
        features = torch.eye(n)
        for i, j in graph.edges():
            features[i, j] = features[j, i] = 1.0
        return features[None]
    if kind == "degree":
        degrees = torch.tensor([graph.degree(i) for i in range(n)], dtype=torch.float)
        buckets = torch.nn.functional.one_hot(degrees.long().clamp(max=15), 16).float()
        return torch.cat([buckets, (degrees / degrees.max())[:, None]], dim=-1)[None]
    raise ValueError(f"unknown features {kind!r}")


def split(labels: torch.Tensor, labelled: str, per_class: int, seed: int) -> torch.Tensor:
    """Bool mask [1, n] of the labelled members: `all`, or `per_class` members per faction (always including the two
    leaders, members 0 and 33)."""
    if labelled == "all":
        return torch.ones_like(labels, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[0, 0] = mask[0, 33] = True
    for c in range(len(FACTIONS)):
        members = (labels[0] == c).nonzero().flatten()
        members = members[(members != 0) & (members != 33)]
        mask[0, members[torch.randperm(len(members), generator=g)[: per_class - 1]]] = True
    return mask


def build_model(num_features: int, args) -> DATForTokenClassification:
    """A tiny bidirectional DAT (2 sensory + 2 relational heads per layer) with a node-feature projection."""
    config = DATEncoderConfig(
        vocab_size=1,  # inputs are node features, not tokens
        num_node_features=num_features,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_sensory_heads=2,
        num_relational_heads=2,
        intermediate_size=2 * args.hidden_size,
        num_symbols=8,
        symbolic_attention_heads=2,
        relational_bias=args.bias,
        position_embedding_type="none",
        symbol_retrieval="symbolic_attention",
        hidden_dropout=args.dropout,
        num_labels=len(FACTIONS),
        id2label=dict(enumerate(FACTIONS)),
        label2id={name: i for i, name in enumerate(FACTIONS)},
    )
    return DATForTokenClassification(config)


def accuracy(logits, labels, mask) -> float:
    """The `accuracy` evaluate module (shipped, offline) on the members in `mask`; NaN for none (the module refuses
    an empty set)."""
    if not mask.any():
        return float("nan")
    metric = load_metric("accuracy")
    return metric.compute(predictions=logits.argmax(-1)[mask].tolist(), references=labels[mask].tolist())["accuracy"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", choices=["onehot", "degree", "adjacency"], default="onehot")
    parser.add_argument("--bias", choices=["graph", "full"], default="graph",
                        help="`full` ignores the friendships (the baseline the graph bias improves on)")
    parser.add_argument("--labelled", choices=["few", "all"], default="few")
    parser.add_argument("--per-class", type=int, default=4, help="labelled members per faction (with --labelled few)")
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-seconds", type=float, default=20.0, help="stop training after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="folder to save the trained model to")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    graph, adjacency, labels = load_karate()
    features = node_features(graph, args.features)
    train_mask = split(labels, args.labelled, args.per_class, args.seed)
    test_mask = ~train_mask
    model = build_model(features.shape[-1], args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_labels = labels.masked_fill(~train_mask, -100)  # unlabelled members are ignored by the loss

    start, step, loss = time.perf_counter(), 0, torch.tensor(float("nan"))
    for step in range(1, args.steps + 1):
        model.train()
        loss = model(node_features=features, graph_adjacency=adjacency, labels=train_labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if time.perf_counter() - start > args.max_seconds:
            break
    model.eval()
    with torch.no_grad():
        logits = model(node_features=features, graph_adjacency=adjacency).logits
    result = {
        "steps": step,
        "seconds": round(time.perf_counter() - start, 2),
        "loss": loss.item(),
        "train_accuracy": accuracy(logits, labels, train_mask),
        "test_accuracy": accuracy(logits, labels, test_mask),
        "accuracy": accuracy(logits, labels, torch.ones_like(train_mask)),
        "labelled": int(train_mask.sum()),
    }
    if not args.quiet:
        print(f"karate club, {args.bias} bias, {args.features} features, {result['labelled']}/34 members labelled, "
              f"{step} steps in {result['seconds']} s")
        print(f"train accuracy {result['train_accuracy']:.3f}  test accuracy {result['test_accuracy']:.3f}  "
              f"all members {result['accuracy']:.3f}")
    if args.save:
        model.save_pretrained(args.save)
    return result


if __name__ == "__main__":
    main()

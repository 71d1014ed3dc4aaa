"""Relational games (Shanahan et al., 2020, "An explicitly relational neural network architecture"), generated offline.

Each image is a 3x3 grid of 12x12-pixel cells (a 36x36 RGB image on black); a cell is empty or holds one object, a
coloured shape drawn in the middle of the cell. The label is a relation among the objects' shapes. The original data
set cannot be downloaded here and its generator is not public: this module writes the tasks from their published
descriptions and samples, with the exact definitions below.

Shapes (`SHAPE_FAMILIES`):
    pentominoes: the 63 fixed pentominoes (every rotation and reflection of the 12 free pentominoes is its own shape),
        one square = 2x2 pixels. The training family.
    hexominoes: the 216 fixed hexominoes, drawn the same way. Held out (out-of-distribution test).
    stripes: 10 striped 10x10 squares: horizontal or vertical stripes 1, 2, 3, 4 or 5 pixels wide, alternating a
        primary colour (first stripe) and a secondary colour. Held out (out-of-distribution test).
Two objects are "the same" when they have the same shape (an identical mask, so mirror images and rotations differ).

Colours (`colors`): `shared` (default) gives every object of an image the same colour (and the same secondary colour),
drawn at random per image from `PALETTE`: objects of the same shape are then pixel-identical copies, as in the
original samples, and colour says nothing about the label. `random` draws each object's colours independently, so
the models must compare shapes across colours.

Tasks (`TASKS`); every data set has `n // 2` positive examples (label 1) in a seeded random order:
    same: three objects in three random cells. 1: two have the same shape and the third differs (A A B);
        0: three different shapes (A B C).
    occurs: one object in a random cell of the top row, three objects filling the bottom row, the middle row empty.
        1: the top shape occurs in the bottom row (A B C below A, in any order);
        0: the bottom row has three other shapes (B C D below A).
    xoccurs: the layout of `occurs`. 1: the top shape occurs in the bottom row exactly once (A B C below A);
        0: it does not occur (B C D) or, with probability 1/2, it occurs twice (A A B, in any order).
    between: three objects filling one random row or column, the rest empty; read along the line as (end, middle,
        end). 1: the two ends have the same shape and the middle another (A B A); 0: three different shapes
        (A B C) or, with probability 1/2, the middle has the shape of one end (A A B or B A A).
    match_pattern: three objects fill the top row and three the bottom row, the middle row empty, with no shape in
        both rows. A row's pattern is which of its objects have equal shapes: AAA, AAB, ABA, ABB or ABC.
        1: the two rows have the same pattern (drawn uniformly); 0: the top row's pattern is drawn uniformly, the
        bottom row's uniformly among the other four.

`generate(task, n, family, seed)` returns uint8 images `[n, 36, 36, 3]` and labels `[n]`, the same for the same
arguments; `relational_games_dataset(...)` wraps them as a `datasets.Dataset` with `pixel_values` (float32
`[3, 36, 36]` in [0, 1], the authors' scaling) and `label`, ready for `DATForImageClassification` and `Trainer`. The
uint8 images also go through `DATImageProcessor` (`do_resize=False`, mean 0, std 1 gives the same `pixel_values`).
"""

from __future__ import annotations

import numpy as np

TASKS = ("same", "occurs", "xoccurs", "between", "match_pattern")
SHAPE_FAMILIES = ("pentominoes", "hexominoes", "stripes")
COLOR_MODES = ("shared", "random")
LABEL_NAMES = ["false", "true"]
CELL = 12  # pixels per grid cell
GRID = 3  # cells per side
IMAGE_SIZE = CELL * GRID
UNIT = 2  # pixels per polyomino square
STRIPE_SIZE = 10  # side of a striped square
ROW_PATTERNS = ("AAA", "AAB", "ABA", "ABB", "ABC")

# 12 well-separated colours (RGB)
PALETTE = np.array([
    [230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200], [245, 130, 48], [145, 30, 180],
    [70, 240, 240], [240, 50, 230], [210, 245, 60], [250, 190, 212], [0, 128, 128], [170, 110, 40],
], dtype=np.uint8)


# ---- shapes ----------------------------------------------------------------------------------------------------------
def _normalize(cells) -> tuple:
    """Translate a set of (row, col) squares to touch row 0 and column 0; a sorted tuple (hashable)."""
    r0 = min(r for r, _ in cells)
    c0 = min(c for _, c in cells)
    return tuple(sorted((r - r0, c - c0) for r, c in cells))


def fixed_polyominoes(order: int) -> list[tuple]:
    """Every fixed polyomino of `order` squares (distinct up to translation only), each a sorted tuple of (row, col)
    squares, grown square by square from the monomino."""
    shapes = {((0, 0),)}
    for _ in range(order - 1):
        grown = set()
        for shape in shapes:
            cells = set(shape)
            for r, c in shape:
                for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                    if (nr, nc) not in cells:
                        grown.add(_normalize(cells | {(nr, nc)}))
        shapes = grown
    return sorted(shapes)


def _symmetries(shape) -> list[tuple]:
    """The 8 images of a polyomino under rotations and reflections (normalized)."""
    images, cells = [], list(shape)
    for _ in range(4):
        cells = [(c, -r) for r, c in cells]  # rotate by 90 degrees
        images += [_normalize(cells), _normalize([(r, -c) for r, c in cells])]
    return images


def free_polyominoes(order: int) -> list[tuple]:
    """One representative (the smallest fixed form) of every free polyomino: distinct up to rotation and reflection."""
    return sorted({min(_symmetries(shape)) for shape in fixed_polyominoes(order)})


def one_sided_polyominoes(order: int) -> list[tuple]:
    """One representative of every one-sided polyomino: distinct up to rotation (reflections count as different)."""
    def rotations(shape):
        return [image for i, image in enumerate(_symmetries(shape)) if i % 2 == 0]

    return sorted({min(rotations(shape)) for shape in fixed_polyominoes(order)})


def polyomino_mask(shape) -> np.ndarray:
    """A polyomino drawn in the middle of a cell: uint8 `[CELL, CELL]`, 1 on the shape, 0 elsewhere."""
    height = (max(r for r, _ in shape) + 1) * UNIT
    width = (max(c for _, c in shape) + 1) * UNIT
    top, left = (CELL - height) // 2, (CELL - width) // 2
    mask = np.zeros((CELL, CELL), dtype=np.uint8)
    for r, c in shape:
        mask[top + r * UNIT: top + (r + 1) * UNIT, left + c * UNIT: left + (c + 1) * UNIT] = 1
    return mask


def stripe_masks() -> list[np.ndarray]:
    """Striped squares: uint8 `[CELL, CELL]`, 1 on primary stripes (the first one), 2 on secondary ones, 0 outside."""
    offset = (CELL - STRIPE_SIZE) // 2
    masks = []
    for vertical in (False, True):
        for width in range(1, 6):
            stripes = (np.arange(STRIPE_SIZE) // width) % 2 + 1  # 1, 1, .., 2, 2, .., 1, ...
            square = np.repeat(stripes[:, None], STRIPE_SIZE, axis=1)
            mask = np.zeros((CELL, CELL), dtype=np.uint8)
            mask[offset:offset + STRIPE_SIZE, offset:offset + STRIPE_SIZE] = square.T if vertical else square
            masks.append(mask)
    return masks


def shape_masks(family: str) -> np.ndarray:
    """The masks of a shape family: uint8 `[num_shapes, CELL, CELL]` (0 background, 1 primary, 2 secondary colour)."""
    if family == "pentominoes":
        return np.stack([polyomino_mask(s) for s in fixed_polyominoes(5)])
    if family == "hexominoes":
        return np.stack([polyomino_mask(s) for s in fixed_polyominoes(6)])
    if family == "stripes":
        return np.stack(stripe_masks())
    raise ValueError(f"`family` must be one of {list(SHAPE_FAMILIES)}, got {family!r}.")


# ---- layouts ---------------------------------------------------------------------------------------------------------
def _distinct(rng, num_shapes: int, k: int) -> list[int]:
    return [int(i) for i in rng.choice(num_shapes, size=k, replace=False)]


def _pattern_shapes(pattern: str, shapes: list[int]) -> list[int]:
    """Shapes of a row following `pattern` (e.g. 'ABA'), letter i taking shapes[i]."""
    return [shapes[ord(letter) - ord("A")] for letter in pattern]


def _layout_same(rng, label, num_shapes):
    cells = [divmod(int(i), GRID) for i in rng.choice(GRID * GRID, size=3, replace=False)]
    a, b, c = _distinct(rng, num_shapes, 3)
    shapes = [a, a, b] if label else [a, b, c]
    return list(zip(cells, [shapes[i] for i in rng.permutation(3)]))


def _layout_occurs(rng, label, num_shapes, exactly_once=False):
    a, b, c, d = _distinct(rng, num_shapes, 4)
    if label:
        bottom = [a, b, c]
    elif exactly_once and rng.random() < 0.5:
        bottom = [a, a, b]  # occurs twice
    else:
        bottom = [b, c, d]
    bottom = [bottom[i] for i in rng.permutation(3)]
    return [((0, int(rng.integers(GRID))), a)] + [((GRID - 1, col), shape) for col, shape in enumerate(bottom)]


def _layout_xoccurs(rng, label, num_shapes):
    return _layout_occurs(rng, label, num_shapes, exactly_once=True)


def _layout_between(rng, label, num_shapes):
    a, b, c = _distinct(rng, num_shapes, 3)
    if label:
        line = [a, b, a]
    elif rng.random() < 0.5:
        line = [a, b, c]
    else:
        line = [a, a, b] if rng.random() < 0.5 else [b, a, a]
    index = int(rng.integers(GRID))
    if rng.random() < 0.5:  # a row
        cells = [(index, k) for k in range(GRID)]
    else:  # a column
        cells = [(k, index) for k in range(GRID)]
    return list(zip(cells, line))


def _layout_match_pattern(rng, label, num_shapes):
    top = ROW_PATTERNS[int(rng.integers(len(ROW_PATTERNS)))]
    others = [p for p in ROW_PATTERNS if p != top]
    bottom = top if label else others[int(rng.integers(len(others)))]
    shapes = _distinct(rng, num_shapes, 6)  # disjoint shapes for the two rows
    top_shapes, bottom_shapes = _pattern_shapes(top, shapes[:3]), _pattern_shapes(bottom, shapes[3:])
    return ([((0, k), s) for k, s in enumerate(top_shapes)]
            + [((GRID - 1, k), s) for k, s in enumerate(bottom_shapes)])


LAYOUTS = {
    "same": _layout_same,
    "occurs": _layout_occurs,
    "xoccurs": _layout_xoccurs,
    "between": _layout_between,
    "match_pattern": _layout_match_pattern,
}


# ---- images ----------------------------------------------------------------------------------------------------------
def _random_colors(rng) -> tuple[np.ndarray, np.ndarray]:
    """A primary and a different secondary colour from the palette."""
    primary, secondary = rng.choice(len(PALETTE), size=2, replace=False)
    return PALETTE[primary], PALETTE[secondary]


def render(objects, masks: np.ndarray, rng, colors: str = "shared") -> np.ndarray:
    """Draw `[((row, col), shape_index), ...]` on a black uint8 image `[IMAGE_SIZE, IMAGE_SIZE, 3]`."""
    image = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    shared = _random_colors(rng)
    for (row, col), shape in objects:
        primary, secondary = shared if colors == "shared" else _random_colors(rng)
        mask = masks[shape]
        cell = image[row * CELL:(row + 1) * CELL, col * CELL:(col + 1) * CELL]
        cell[mask == 1] = primary
        cell[mask == 2] = secondary
    return image


def _check_args(task, n, family, colors):
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {list(TASKS)}, got {task!r}.")
    if family not in SHAPE_FAMILIES:
        raise ValueError(f"`family` must be one of {list(SHAPE_FAMILIES)}, got {family!r}.")
    if colors not in COLOR_MODES:
        raise ValueError(f"`colors` must be one of {list(COLOR_MODES)}, got {colors!r}.")
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"`n` (number of images) must be a positive integer, got {n!r}.")


def generate(task: str, n: int, family: str = "pentominoes", seed: int = 0,
             colors: str = "shared") -> tuple[np.ndarray, np.ndarray]:
    """`n` images of a task: uint8 `[n, 36, 36, 3]` and int64 labels `[n]` with `n // 2` ones (seeded order).
    The same arguments give the same arrays."""
    _check_args(task, n, family, colors)
    masks = shape_masks(family)
    rng = np.random.default_rng([seed, TASKS.index(task), SHAPE_FAMILIES.index(family)])
    labels = rng.permutation(np.arange(n) < n // 2).astype(np.int64)
    layout = LAYOUTS[task]
    images = np.stack([render(layout(rng, bool(label), len(masks)), masks, rng, colors) for label in labels])
    return images, labels


def relational_games_dataset(task: str, n: int, family: str = "pentominoes", seed: int = 0, colors: str = "shared"):
    """A `datasets.Dataset` of `n` images of a task: `pixel_values` float32 `[3, 36, 36]` in [0, 1] and `label`
    (ClassLabel false/true), in torch format."""
    import datasets

    images, labels = generate(task, n, family, seed, colors)
    features = datasets.Features({
        "pixel_values": datasets.Array3D(shape=(3, IMAGE_SIZE, IMAGE_SIZE), dtype="float32"),
        "label": datasets.ClassLabel(names=LABEL_NAMES),
    })
    pixel_values = images.transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    data = datasets.Dataset.from_dict({"pixel_values": pixel_values, "label": labels.tolist()}, features=features)
    return data.with_format("torch")


__all__ = [
    "TASKS", "SHAPE_FAMILIES", "COLOR_MODES", "LABEL_NAMES", "PALETTE", "IMAGE_SIZE", "CELL", "GRID",
    "fixed_polyominoes", "free_polyominoes", "one_sided_polyominoes", "polyomino_mask", "stripe_masks",
    "shape_masks", "render", "generate", "relational_games_dataset",
]

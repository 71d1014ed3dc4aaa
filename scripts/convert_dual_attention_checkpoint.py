#!/usr/bin/env python
"""Convert an authors' `dual_attention` checkpoint folder into a dat_hf model folder.

    python scripts/convert_dual_attention_checkpoint.py --input DAT-sa8-ra8-ns1024-sh8-nkvh4-343M --output dat-343m

The input is the authors' Hub format (e.g. `awni00/DAT-sa8-ra8-ns1024-sh8-nkvh4-343M` once downloaded): `config.json`
with the constructor kwargs and `model.safetensors`. The output loads with
`AutoModelForCausalLM.from_pretrained(output)` (or with `trust_remote_code=True` where dat_hf is not installed).
Safetensors only: nothing is unpickled.
"""

import argparse

import torch

from dat_hf.conversion import convert_checkpoint_folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="folder with config.json and model.safetensors")
    parser.add_argument("--output", required=True, help="dat_hf output folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    args = parser.parse_args(argv)
    model = convert_checkpoint_folder(args.input, args.output, dtype=getattr(torch, args.dtype) if args.dtype else None)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.output}: {type(model).__name__}, {n_params:,} parameters")


if __name__ == "__main__":
    main()

"""`python -m dat_hf.kernels build | status`: build the compiled CPU kernels ahead of their first use (e.g. in a
Docker image or on a cluster's login node: the cache key includes the CPU's instruction set, so build on the kind of
machine that runs the models), or show where they are cached (and whether that cache is writable: a read-only one
serves its verified build as it is) and whether they are built and verified. `build` verifies a cached build (its
record in build.json and a load in a child process) and rebuilds one that fails."""

import argparse
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dat_hf.kernels", description=__doc__)
    parser.add_argument("command", choices=["build", "status"])
    args = parser.parse_args(argv)

    from . import cpu_build

    if args.command == "status":
        for key, value in cpu_build.status().items():
            print(f"{key:15} {value}")
        return 0
    start = time.monotonic()
    try:  # `deep`: the cached library is also loaded and called in a child process (never here: see cpu_build)
        library, built = cpu_build.ensure_built(announce=lambda message: print(message, file=sys.stderr, flush=True),
                                                deep=True)
    except cpu_build.KernelBuildError as error:
        print(f"dat_hf: the CPU kernels could not be built: {error}", file=sys.stderr)
        return 1
    print(f"{'built' if built else 'already built'} in {time.monotonic() - start:.1f} s: {library} (verified: loaded "
          "and called in a child process; its size and sha256 are in build.json)")
    return 0

if __name__ == "__main__":
    sys.exit(main())

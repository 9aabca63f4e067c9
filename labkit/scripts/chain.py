"""Run several torchrun scripts one after another in the same ranks (`labkit.parallel.launch([...])`).

torchrun -m labkit.scripts.chain labkit.scripts.tensor_parallel labkit.scripts.pipeline_parallel
The ranks join the process group once (a second `init_process_group` in the same processes can hang)
and leave it at the end. LABKIT_RESULT holds one result file per script (os.pathsep-separated);
before each script's `main()` it is set to that script's own file.
"""
import importlib
import os
import sys

import torch.distributed as dist


def main():
    results = os.environ.get("LABKIT_RESULT", "").split(os.pathsep)
    os.environ["LABKIT_CHAINED"] = "1"
    for i, name in enumerate(sys.argv[1:]):
        os.environ["LABKIT_RESULT"] = results[i] if i < len(results) else ""
        importlib.import_module(name).main()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Run several torchrun scripts one after another in the same ranks (`labkit.launch.launch([...])`).

torchrun -m labkit.scripts.chain labkit.scripts.tensor_parallel labkit.scripts.pipeline_parallel
The ranks join the process group once (a second `init_process_group` in the same processes can hang)
and leave it at the end. LABKIT_RESULT holds one result file per script (os.pathsep-separated);
before each script's `main()` it is set to that script's own file.
"""
import importlib
import os
import sys

import torch.distributed as dist

from labkit.launch import leave, progress


def main():
    progress(f"Python and torch loaded; importing {', '.join(name.rsplit('.', 1)[-1] for name in sys.argv[1:])}",
             every_rank=True)
    results = os.environ.get("LABKIT_RESULT", "").split(os.pathsep)
    os.environ["LABKIT_CHAINED"] = "1"
    for i, name in enumerate(sys.argv[1:]):
        os.environ["LABKIT_RESULT"] = results[i] if i < len(results) else ""
        importlib.import_module(name).main()
    if dist.is_initialized():
        leave()                             # no rank leaves while a peer still receives; no teardown abort


if __name__ == "__main__":
    main()

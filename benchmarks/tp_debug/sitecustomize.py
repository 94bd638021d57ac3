"""Loaded by every Python process started with this folder on PYTHONPATH (spawned TP workers
too): with NANOVLLM_DUMP=DIR, each process writes its threads' stacks to DIR/stack.PID.txt every
DUMP_AFTER seconds (45), so a stalled run shows where every rank waits. DBG_CAPTURE_MODE sets
torch.cuda.graph's default capture_error_mode (e.g. thread_local) to test that as a cause."""
import faulthandler
import logging
import os

_dump_dir = os.environ.get("NANOVLLM_DUMP")
if _dump_dir:
    _file = open(f"{_dump_dir}/stack.{os.getpid()}.txt", "w")
    faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER", "45")), repeat=True,
                                      file=_file)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(relativeCreated)8.0f pid{os.getpid()} %(name)s %(message)s")

_capture_mode = os.environ.get("DBG_CAPTURE_MODE")
if _capture_mode:
    import torch

    _graph_init = torch.cuda.graph.__init__

    def _graph_init_with_mode(self, cuda_graph, pool=None, stream=None,
                              capture_error_mode=_capture_mode):
        _graph_init(self, cuda_graph, pool, stream, capture_error_mode)

    torch.cuda.graph.__init__ = _graph_init_with_mode

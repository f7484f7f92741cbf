"""Stand-ins for other libraries' stream objects (no PyTorch needed)."""


class TorchLikeStream:
    """torch.cuda.Stream / torch.cuda.ExternalStream: the handle is ``.cuda_stream``."""

    def __init__(self, h):
        self.cuda_stream = h
        self.device = "cuda:0"

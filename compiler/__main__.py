import logging
import sys
import warnings

# Dependencies log import-time noise (torchao's optional CUDA kernels, pytree
# deprecations) that says nothing about the user's model; keep the CLI quiet.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", category=FutureWarning)

from compiler.cli import main  # noqa: E402

sys.exit(main())

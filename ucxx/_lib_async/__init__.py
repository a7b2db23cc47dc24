"""The asyncio layer of ucxx (Python wrappers over the C extension)."""

from .application_context import ApplicationContext  # noqa: F401
from .endpoint import Endpoint  # noqa: F401
from .listener import Listener  # noqa: F401

"""Exceptions raised by ucxx.

All of them are defined by the C extension (``csrc/status.c`` maps every
``ucs_status_t`` to one class) and are re-exported here, flat: every class is
a direct subclass of :class:`UCXError`, which derives from ``Exception``.

``UCXCanceled`` and ``UCXMsgTruncated`` are aliases kept for code written
against older ucx-py releases.
"""

from . import _ucxx

UCXError = _ucxx.UCXError
UCXCanceledError = _ucxx.UCXCanceledError
UCXCloseError = _ucxx.UCXCloseError
UCXConfigError = _ucxx.UCXConfigError
UCXConnectionResetError = _ucxx.UCXConnectionResetError
UCXMessageTruncatedError = _ucxx.UCXMessageTruncatedError
UCXNotConnectedError = _ucxx.UCXNotConnectedError
UCXUnreachableError = _ucxx.UCXUnreachableError
UCXTimedOutError = _ucxx.UCXTimedOutError
UCXNoMemoryError = _ucxx.UCXNoMemoryError
UCXNoResourceError = _ucxx.UCXNoResourceError
UCXInvalidParamError = _ucxx.UCXInvalidParamError
UCXBusyError = _ucxx.UCXBusyError
UCXUnsupportedError = _ucxx.UCXUnsupportedError
UCXRejectedError = _ucxx.UCXRejectedError
UCXNoDeviceError = _ucxx.UCXNoDeviceError
UCXEndpointTimeoutError = _ucxx.UCXEndpointTimeoutError
UCXBufferTooSmallError = _ucxx.UCXBufferTooSmallError

# Compatibility aliases (ucx-py / RAPIDS ucxx spellings).
UCXCanceled = UCXCanceledError
UCXMsgTruncated = UCXMessageTruncatedError

__all__ = [
    "UCXError",
    "UCXCanceledError",
    "UCXCloseError",
    "UCXConfigError",
    "UCXConnectionResetError",
    "UCXMessageTruncatedError",
    "UCXNotConnectedError",
    "UCXUnreachableError",
    "UCXTimedOutError",
    "UCXNoMemoryError",
    "UCXNoResourceError",
    "UCXInvalidParamError",
    "UCXBusyError",
    "UCXUnsupportedError",
    "UCXRejectedError",
    "UCXNoDeviceError",
    "UCXEndpointTimeoutError",
    "UCXBufferTooSmallError",
    "UCXCanceled",
    "UCXMsgTruncated",
]

# Any further status class the extension defines (it may map more statuses
# than the ones listed above) is exported too.
for _name in dir(_ucxx):
    _obj = getattr(_ucxx, _name)
    if (
        isinstance(_obj, type)
        and issubclass(_obj, _ucxx.UCXError)
        and _name not in globals()
    ):
        globals()[_name] = _obj
        __all__.append(_name)
del _name, _obj

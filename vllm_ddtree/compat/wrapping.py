"""How a seam of ``seams.SEAMS`` is applied to vLLM.

Every vLLM function, method, property or module attribute the plugin wraps or replaces goes
through the helpers here (called by ``seams.install``), so that all of them share:

* one applied-marker (``APPLIED``): a wrapper carries it, and wrapping again is a no-op (the
  plugin is applied once per process, in every process vLLM starts);
* one error type (``VLLMIncompatibleError``), raised at install time with the installed vLLM's
  version and the first symbol that is gone or whose leading parameters changed;
* the wrapped original as the wrapper's ``__wrapped__``.

(How an engine's config carries DDTree's is ``config.get_ddtree_config``, re-exported by
``compat``.) Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

WRITTEN_FOR_VLLM = "0.26.0"
APPLIED = "__vllm_ddtree_patched__"


class VLLMIncompatibleError(RuntimeError):
    """The installed vLLM no longer has what a vllm-ddtree patch wraps."""


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - reported, never fatal here
        return "unknown"


def incompatible(what: str) -> VLLMIncompatibleError:
    return VLLMIncompatibleError(
        f"vllm-ddtree: {what}; this plugin was written for vLLM {WRITTEN_FOR_VLLM}, "
        f"installed: vLLM {vllm_version()}"
    )


def is_applied(fn: Any) -> bool:
    return bool(getattr(fn, APPLIED, False))


def check_signature(fn: Callable, expected: Sequence[str], where: str) -> None:
    """Raise unless ``fn``'s leading parameters are ``expected`` (by name, in order)."""
    fn = inspect.unwrap(fn)
    params = list(inspect.signature(fn).parameters)[: len(expected)]
    if params != list(expected):
        raise incompatible(f"{where}{tuple(params)} changed (expected {tuple(expected)})")


def _marked_wrapper(original: Callable, make_wrapper: Callable[[Callable], Callable]):
    """``make_wrapper(original)`` with ``original``'s name, docs and ``__wrapped__``, marked
    ``APPLIED``."""
    wrapped = functools.wraps(original)(make_wrapper(original))
    setattr(wrapped, APPLIED, True)
    return wrapped


def wrap_function(
    owner: Any,
    name: str,
    where: str,
    make_wrapper: Callable[[Callable], Callable],
    expected: Sequence[str] | None = None,
) -> None:
    """``owner.name = make_wrapper(original)`` once per process (a class's method or a module's
    function); ``expected``: the leading parameters the wrapper binds, checked first."""
    original = getattr(owner, name, None)
    if original is None:
        raise incompatible(f"{where}.{name} is gone")
    if is_applied(original):
        return
    if expected is not None:
        check_signature(original, expected, f"{where}.{name}")
    setattr(owner, name, _marked_wrapper(original, make_wrapper))


def wrap_classmethod(cls: type, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Like ``wrap_function`` for a classmethod: the wrapper gets the underlying function
    (``cls`` first) and is installed as a classmethod again."""
    member = cls.__dict__.get(name)
    if not isinstance(member, classmethod):
        raise incompatible(f"{cls.__name__}.{name} is no longer a classmethod")
    if is_applied(member.__func__):
        return
    setattr(cls, name, classmethod(_marked_wrapper(member.__func__, make_wrapper)))


def wrap_property(cls: type, name: str, make_getter: Callable[[Callable], Callable]) -> None:
    """``cls.name`` becomes ``property(make_getter(original getter))`` once per process."""
    prop = cls.__dict__.get(name)
    if not isinstance(prop, property):
        raise incompatible(f"{cls.__name__}.{name} is no longer a property")
    if is_applied(prop.fget):
        return
    setattr(cls, name, property(_marked_wrapper(prop.fget, make_getter)))


def replace_attribute(owner: Any, name: str, where: str, value: Any, base: type) -> None:
    """``owner.name = value`` where vLLM has a ``base`` there (e.g. its proposer class, which
    the model runner instantiates by that name)."""
    current = getattr(owner, name, None)
    if current is value:
        return
    if current is not base or not issubclass(value, base):
        raise incompatible(f"{where}.{name} is {current!r}, not vLLM's {base.__name__}")
    setattr(owner, name, value)


def alias_enum_member(enum: Any, alias: str, member: Any) -> None:
    """``enum[alias]`` names ``member`` too (it pickles as ``member``)."""
    if alias not in enum._member_map_:
        enum._member_map_[alias] = member


@functools.lru_cache(maxsize=64)
def _signature_of(fn: Callable) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(fn))


def bind_arguments(original: Callable, *args: Any, **kwargs: Any) -> inspect.BoundArguments:
    """vLLM's arguments to ``original`` (a wrapped function), bound by name: a wrapper reads
    ``bound.arguments["name"]`` whether vLLM passed it by position or keyword, and may change
    it before ``original(*bound.args, **bound.kwargs)``."""
    return _signature_of(original).bind(*args, **kwargs)

"""Every user-facing failure is an AotbuildError; the CLI prints its message and hint, never a traceback."""

from __future__ import annotations


class AotbuildError(Exception):
    """Base class. `hint` is the next step to suggest to the user, if there is one; `str()` (what a
    traceback shows) gives the message and the hint, `message` the message alone."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message + (f"\nhint: {self.hint}" if self.hint else "")


class TargetError(AotbuildError):
    """A target file is missing, malformed or asks for something impossible."""

    exit_code = 2


class ArgumentError(AotbuildError):
    """A command-line value the command cannot take, found before anything loads: a usage error."""

    exit_code = 2


class SourceError(AotbuildError):
    """The pipeline source (Hub id, folder or random config set) cannot be read."""


class BuildError(AotbuildError):
    """A build step failed: export, compile, packaging."""


class NumericsError(BuildError):
    """A compiled variant's output differs from eager beyond its tolerance."""


class ArtifactError(AotbuildError):
    """An artifact folder cannot be used."""


class IncompatibleArtifactError(ArtifactError):
    """The artifact was built for another machine, torch or dtype."""

    def __init__(self, field: str, found: object, expected: object, *, hint: str | None = None) -> None:
        super().__init__(
            f"artifact does not fit this machine: {field} is {expected!r} in the artifact, "
            f"{found!r} here",
            hint=hint or "rebuild the artifact on this machine: aotbuild build --target NAME --force",
        )
        self.field, self.found, self.expected = field, found, expected


class WeightsMismatchError(IncompatibleArtifactError):
    """Weights given for an artifact's compiled code are of another architecture (a tensor missing,
    another shape, or one the code does not read), or their config differs where it is compiled."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        ArtifactError.__init__(self, message, hint=hint or "use weights of the architecture the artifact was built "
                                                           "for, or build a target for these weights")
        self.field, self.found, self.expected = "weights", None, None


class PrecisionError(IncompatibleArtifactError):
    """An artifact computes in another dtype than the pipeline or the checkpoint given to it: its
    images would not be the ones those make eager. Refused unless the caller names the artifact's
    dtype (`dtype=`, `--dtype`)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        ArtifactError.__init__(self, message, hint=hint)
        self.field, self.found, self.expected = "dtype", None, None


class CorruptArtifactError(ArtifactError):
    """A file of the artifact is missing or fails its sha256."""


class ShapeNotSupportedError(AotbuildError):
    """A call's input shapes match no compiled variant."""


class UnsupportedCallError(AotbuildError):
    """A call on a compiled component that aotbuild cannot honour exactly (another dtype or device,
    autocast, layerwise casting, another attention kernel, saving diffusers weights): refused
    before anything changes."""


class LossyInputError(AotbuildError):
    """A call's input would change value on its way to the compiled model's dtype (a fractional
    timestep into a model compiled for int64 ones): refused, never rounded."""


class MissingAttributeError(AotbuildError, AttributeError):
    """An attribute the eager module has and aotbuild's stand-in does not keep. An AttributeError
    too, so `hasattr` and `getattr(..., default)` in diffusers keep working."""

    def __init__(self, component: str, name: str, message: str | None = None, hint: str | None = None) -> None:
        super().__init__(message or f"{component} is compiled by aotbuild and has no attribute {name!r}: the "
                                    f"stand-in keeps the config, dtype, device, the attributes the pipeline reads "
                                    f"and the calls it makes",
                         hint=hint or "call it on an eager pipeline, or load the artifact with eager_fallback=True "
                                      "for calls the compiled code does not cover")


class UntrustedCodeError(AotbuildError):
    """An artifact from a Hub repo (native code) loaded without `trust_remote_code=True`."""


class HubError(AotbuildError):
    """A Hub request failed (network, auth, missing repo or revision)."""


class NoMatchingVariantError(AotbuildError):
    """A Hub repo holds no artifact variant that fits this machine."""


class BenchError(AotbuildError):
    """A benchmark's worker process failed or ran past its time."""


class RequestError(AotbuildError):
    """A request the server refuses (answered, not raised to a caller); `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ReplicaLostError(AotbuildError):
    """A request's replica stopped before it answered, twice (answered with a 503)."""

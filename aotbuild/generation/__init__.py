"""What `aotbuild run`, `aotbuild serve` and `aotbuild bench` share: a target's pipeline three ways
and one generation (`backends`: aot, eager, compile), pictures and videos in and out (`media`)."""

"""Structured output: a request's constraint (a JSON schema, a regex, a list of choices) becomes a
grammar matcher per sequence, whose token mask the sampler applies on device.

- spec.py: `StructuredOutput`, what a request asks for (library-neutral; SamplingParams holds it);
- grammar.py: the one module that speaks to the grammar library (llguidance): compiling, the
  per-sequence matcher, checking a constraint;
- masks.py: the packed bitmask rows of a step's sampling rows (filled on the host, applied in
  jaxserve/sampling.py).

Why llguidance: benchmarks/results/structured_output.md.
"""
from jaxserve.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]

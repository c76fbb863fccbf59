"""Structured output in the engine core: constraints compiled off the loop, a matcher per request, the step's mask."""

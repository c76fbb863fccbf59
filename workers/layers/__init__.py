"""Building blocks shared by every model: linear, norm, rotary, attention, sampler."""

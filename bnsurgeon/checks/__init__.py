"""Proof that a conversion preserves outputs: the check input, the pre-write eval check, verify's
eval/train/N-rank checks, the fused checks, and the pool of gloo ranks they run on."""

"""Model building blocks: rotary embedding, RMSNorm, and the fused projections' weight maps."""

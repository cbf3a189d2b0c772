"""Request schemas (attrs classes), their strict structuring from JSON, and the OpenAPI description built from them."""

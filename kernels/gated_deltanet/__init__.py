"""Gated DeltaNet backends: sequential reference (`naive`) and chunked WY form (`chunk`)."""

"""Operations tools: `status`, `health`, the Prometheus exporter and Flower."""

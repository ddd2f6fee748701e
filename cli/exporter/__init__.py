"""`ratchet export`: an alias's scored groups, ratings, gate pairs or traffic as a Hugging Face
`datasets`-ready folder (Parquet or JSON Lines shards and a dataset card). ``rows`` turns records
into rows (pure); ``run`` streams them out of Kafka, resumably."""

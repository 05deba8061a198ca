"""memfilter: a Kafka stream processor that filters echoed chat history against stored memory."""

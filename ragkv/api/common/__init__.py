"""What the endpoints share: protocol bases and parts, the serving helpers, the
conversion of request options into the application's typed configs."""

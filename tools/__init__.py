"""User tools, installed as `pallasite.tools`: the sharding-plan explorer (`plan/`)."""

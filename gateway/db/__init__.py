"""The admin DB: SQLAlchemy 2 async models, engine/session setup and Alembic migrations."""

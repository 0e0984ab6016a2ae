"""The cluster tier's wire-independent parts: value keys and the header every value carries."""

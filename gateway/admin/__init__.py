"""The admin API (`/admin/api/v1`): tenants, keys, prices, reports, audit log."""

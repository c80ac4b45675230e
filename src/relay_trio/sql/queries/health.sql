-- name: select_one
SELECT 1;
